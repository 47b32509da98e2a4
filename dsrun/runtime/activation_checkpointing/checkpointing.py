"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`).

    dsrun.checkpointing.configure(mpu, deepspeed_config=cfg)   # or keyword options
    hidden = dsrun.checkpointing.checkpoint(block, hidden)      # instead of block(hidden)

`checkpoint(function, *args)` keeps only the inputs of `function` during
forward and runs it again in backward to rebuild what backward needs
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). It is
torch.utils.checkpoint in its non-reentrant form, with the RNG state saved
and restored, so dropout draws the same mask in the recomputation.

[Note: where checkpointed inputs live]
What a checkpointed region keeps between forward and backward is its
inputs: non-reentrant checkpointing holds them in the closure it
recomputes from. Two options move them, each as an autograd op placed in
front of the region, with the inverse op as the region's first step (so
that the recomputation performs it again):
- cpu_checkpointing: the inputs are copied to host memory (the copy's
  backward moves the gradient back); on a GPU machine the device copy is
  freed and the input waits in RAM. On the CPU it changes nothing, and
  configure() says so once.
- partition_activations (with an `mpu`): each rank of the model-parallel
  group keeps 1/N of every input (its slice of the flattened tensor) and
  the region all-gathers it; the gradient is all-gathered back in
  backward. Model-parallel ranks hold identical activations, so N ranks
  together store one copy. Without an mpu there is no such group and
  configure() says once that it has no effect.
The collectives are dsrun.runtime.comm's.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from dsrun.accelerator import get_accelerator
from dsrun.runtime.parallel.mesh import current as current_mesh
from dsrun.runtime import comm
from dsrun.runtime.observability.logging import logger

__all__ = ["CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "reset"]


class _Options:
    """The configured behaviour (module-level, as in DeepSpeed)."""

    configured = False
    mpu = None
    partition_activations = False
    cpu_checkpointing = False
    contiguous_checkpointing = False
    num_checkpoints: int | None = None
    synchronize = False
    profile = False


_said: set[str] = set()


def _say_once(key: str, text: str) -> None:
    if key not in _said and comm.get_rank() == 0:
        logger.info(text)
    _said.add(key)


def _section(deepspeed_config) -> dict[str, Any]:
    """The activation_checkpointing section of a DsConfig, a config dict or a config file."""
    from dsrun.runtime.config import ActivationCheckpointingConfig, DsConfig, _read_file
    if isinstance(deepspeed_config, DsConfig):
        return deepspeed_config.activation_checkpointing.model_dump()
    raw = deepspeed_config if isinstance(deepspeed_config, dict) else _read_file(Path(deepspeed_config))
    section = raw.get("activation_checkpointing", {}) if isinstance(raw, dict) else {}
    return ActivationCheckpointingConfig.model_validate(section).model_dump()


def configure(mpu_, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set how `checkpoint` behaves (DeepSpeed's signature).

    Args:
        mpu_: model-parallel unit (Megatron's mpu: get_model_parallel_group(),
            get_model_parallel_rank(), get_model_parallel_world_size()), or None.
        deepspeed_config: a ds_config (DsConfig, dict or file path) whose
            "activation_checkpointing" section gives the defaults.
        partition_activations: split checkpointed inputs across the mpu's group.
        contiguous_checkpointing: accepted; inputs are not copied into one
            buffer (the allocator handles them).
        num_checkpoints: accepted with contiguous_checkpointing.
        checkpoint_in_cpu: keep checkpointed inputs in host memory.
        synchronize: synchronize the device at each checkpoint's start and end.
        profile: log the forward and recompute time of each checkpoint.

    Raises:
        dsrun.runtime.config.ConfigError: the config section is invalid.
    """
    values = _section(deepspeed_config) if deepspeed_config is not None else {}
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values.update({k: v for k, v in given.items() if v is not None})
    _Options.mpu = mpu_
    _Options.partition_activations = bool(values.get("partition_activations", False))
    _Options.cpu_checkpointing = bool(values.get("cpu_checkpointing", False))
    _Options.contiguous_checkpointing = bool(values.get("contiguous_memory_optimization", False))
    _Options.num_checkpoints = values.get("number_checkpoints")
    _Options.synchronize = bool(values.get("synchronize_checkpoint_boundary", False))
    _Options.profile = bool(values.get("profile", False))
    _Options.configured = True
    if _Options.partition_activations and mpu_ is None:
        _say_once("partition", "dsrun: activation_checkpointing.partition_activations has no effect without a "
                               "model-parallel unit (configure(mpu_, ...)): there is no group to split across")
    if _Options.cpu_checkpointing and not torch.cuda.is_available():
        _say_once("cpu", "dsrun: activation_checkpointing.cpu_checkpointing: activations already live in host "
                         "memory on the CPU, so it changes nothing here")


def is_configured() -> bool:
    """True once configure() ran (checkpoint() works without it, with the defaults)."""
    return _Options.configured


def reset() -> None:
    """Release per-iteration checkpointing state. dsrun keeps none (no
    contiguous buffers), so this only exists for DeepSpeed's call sites."""


# -- moving checkpointed inputs (see [Note: where checkpointed inputs live]) ----------------

class _ToHost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.device = x.device
        return x.detach().to("cpu", copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.device)


def _partition_layout(numel: int, world: int) -> int:
    return -(-numel // world)  # elements per rank, the last padded


class _KeepSlice(torch.autograd.Function):
    """Forward: this rank's slice of x (flattened, zero-padded to N equal
    parts), shape (ceil(numel/N),). Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        ctx.shape, ctx.group, ctx.world = x.shape, group, world
        per = _partition_layout(x.numel(), world)
        flat = torch.zeros(per * world, dtype=x.dtype, device=x.device)
        flat[:x.numel()] = x.detach().reshape(-1)
        return flat[rank * per:(rank + 1) * per].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = torch.empty(grad.numel() * ctx.world, dtype=grad.dtype, device=grad.device)
        comm.all_gather_into_tensor(full, grad.contiguous(), group=ctx.group)
        numel = torch.Size(ctx.shape).numel()
        return full[:numel].view(ctx.shape), None, None, None


class _GatherSlices(torch.autograd.Function):
    """Inverse of _KeepSlice: all-gather the slices into the full tensor;
    backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, shape, group, rank: int, world: int) -> torch.Tensor:
        ctx.rank, ctx.per, ctx.numel = rank, piece.numel(), torch.Size(shape).numel()
        full = torch.empty(piece.numel() * world, dtype=piece.dtype, device=piece.device)
        comm.all_gather_into_tensor(full, piece.contiguous(), group=group)
        return full[:ctx.numel].view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo = ctx.rank * ctx.per
        hi = min(lo + ctx.per, ctx.numel)
        piece = torch.zeros(ctx.per, dtype=grad.dtype, device=grad.device)
        piece[:max(hi - lo, 0)] = grad.reshape(-1)[lo:hi]
        return piece, None, None, None, None


def _stash(args: tuple) -> tuple[tuple, Callable]:
    """Move the tensor inputs where the options say; return them and the
    function that brings them back (run inside the checkpointed region)."""
    move_to_host = _Options.cpu_checkpointing and torch.cuda.is_available()
    mpu = _Options.mpu if _Options.partition_activations else None
    if not move_to_host and mpu is None:
        return args, lambda *a: a
    group = mpu.get_model_parallel_group() if mpu is not None else None
    rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    world = mpu.get_model_parallel_world_size() if mpu is not None else 1
    plan = []
    stashed = []
    for a in args:
        if not (torch.is_tensor(a) and a.is_floating_point()):
            plan.append(None)
            stashed.append(a)
            continue
        plan.append((a.shape, a.device))
        if world > 1:
            a = _KeepSlice.apply(a, group, rank, world)
        if move_to_host:
            a = _ToHost.apply(a)
        stashed.append(a)

    def restore(*held):
        out = []
        for a, spec in zip(held, plan):
            if spec is not None:
                shape, device = spec
                a = a.to(device)
                if world > 1:
                    a = _GatherSlices.apply(a, shape, group, rank, world)
            out.append(a)
        return tuple(out)
    return tuple(stashed), restore


@contextlib.contextmanager
def _boundary(name: str):
    if _Options.synchronize:
        get_accelerator().synchronize()
    timer = time.perf_counter() if _Options.profile else None
    try:
        yield
    finally:  # a recomputation may stop early, by an exception, once backward has what it needs
        if _Options.synchronize:
            get_accelerator().synchronize()
        if timer is not None:
            logger.info(f"dsrun checkpoint {name}: {(time.perf_counter() - timer) * 1e3:.2f} ms")


def checkpoint(function: Callable, *args):
    """Run `function(*args)` keeping only its inputs for backward, which runs
    it again (non-reentrant torch.utils.checkpoint, RNG state restored).

    Args:
        function: the region, e.g. a transformer block.
        args: its positional inputs; tensors keep their autograd history.

    Returns:
        What `function` returns.
    """
    stashed, restore = _stash(args)
    calls = []
    tracked = _TRACKER.get_states()  # the recomputation replays the model-parallel RNG states too

    def region(*held):
        calls.append(None)  # the first call is forward, the second the recomputation in backward
        if len(calls) == 1:
            with _boundary("forward"):
                return function(*restore(*held))
        now = _TRACKER.get_states()
        _TRACKER.set_states(tracked)
        try:
            with _boundary("recompute"):
                return function(*restore(*held))
        finally:
            _TRACKER.set_states(now)
    return torch.utils.checkpoint.checkpoint(region, *stashed, use_reentrant=False, preserve_rng_state=True)


non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for the non-reentrant variant


# -- model-parallel RNG (Megatron's names) --------------------------------------------------

MODEL_PARALLEL_RNG = "model-parallel-rng"


class CudaRNGStatesTracker:
    """Named RNG states of the accelerator: `fork(name)` runs a block with
    that state and stores what it advanced to, then restores the previous
    state (Megatron-LM's tracker; on the CPU it tracks torch's CPU generator)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create state `name` from `seed`. Raises ValueError for a name or seed used twice."""
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        acc = get_accelerator()
        saved = acc.get_rng_state()
        acc.manual_seed(seed)
        self.states[name] = acc.get_rng_state()
        acc.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with RNG state `name`. Raises KeyError for an unknown name."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added (call model_parallel_cuda_manual_seed)")
        acc = get_accelerator()
        saved = acc.get_rng_state()
        acc.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = acc.get_rng_state()
            acc.set_rng_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with `seed` (same on every model-parallel
    rank) and the tracker's model-parallel state with seed + 2718 + the
    model-parallel rank (Megatron-LM's offsets): the configured mpu's, else
    the current mesh's model axis rank. The tensor-parallel layers draw from
    that state inside their split regions (see [Note: dropout in
    tensor-parallel regions] in dsrun/runtime/parallel/tensor/random.py)."""
    mp_rank = _Options.mpu.get_model_parallel_rank() if _Options.mpu is not None else current_mesh().rank("model")
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + mp_rank)
