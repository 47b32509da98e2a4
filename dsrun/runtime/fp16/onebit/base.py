"""What the 1-bit optimizers share: who communicates, error buffers, masks, checkpoint extras.

[Note: the optimizer owns gradient communication]
A `CompressedCommOptimizer` decides, step by step, whether the engine
all-reduces the gradients of the coming step (`gradients_averaged()`:
True during warm-up, and on 0/1 Adam's variance-update steps) or hands
each rank its local gradients, which the optimizer then exchanges itself
in compressed form (`compressed_mean`). The decision depends only on
counters every rank holds identically, so all ranks issue the same
collectives. The engine's strategy for these optimizers
(dsrun/runtime/compression/onebit_strategy.py) asks before each backward.
Used outside an engine (a plain training loop that all-reduces itself),
`gradients_averaged()` tells the loop what to do.

[Note: momentum masks]
1-bit compression cannot send an exact zero, so an element whose momentum
should stay zero (a parameter that never gets a gradient, e.g. position
embeddings past the sequence length in use) would drift with the
compression error. DeepSpeed asks the user for an `exp_avg_mask` per
parameter group. dsrun derives it: the variance is frozen when compression
starts, and an element whose variance is exactly zero never saw a non-zero
(averaged) gradient, so every compressed result is multiplied by
(exp_avg_sq != 0). A user's `exp_avg_mask` in a parameter group (same
shape as the group's tensors) is applied as well.

[Note: error buffers in checkpoints]
Worker and server errors differ per rank, and the server error's size
depends on the world size, so they are not optimizer state of a
parameter: `checkpoint_extras()` returns them as this rank's own tensors
and `load_checkpoint_extras()` restores them when the world size and
tensor sizes match; otherwise they restart from zero (DeepSpeed always
resets them on load) and the returned message says so.
"""
from __future__ import annotations

import abc

import torch

from dsrun.ops.optimizer_base import OptimizerBase
from dsrun.runtime import comm
from dsrun.runtime.comm.compressed import compressed_all_reduce, server_chunk_numel

COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed", "gloo")


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """p's state with step (0-dim fp32), exp_avg and exp_avg_sq (fp32, p's shape)."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    return state



class CompressedCommOptimizer(OptimizerBase, abc.ABC):
    """Base class: see [Note: the optimizer owns gradient communication].

    Subclasses call `_setup_comm(cuda_aware, comm_backend_name)` in their
    constructor and implement `gradients_averaged`.

    Attributes:
        comm_group: process group of the data-parallel ranks (None = all);
            the engine sets it.
    """

    comm_group = None

    def _setup_comm(self, cuda_aware: bool, comm_backend_name: str) -> None:
        name = type(self).__name__
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"{name}: comm_backend_name={comm_backend_name!r} is not one of "
                             f"{', '.join(COMM_BACKENDS)}")
        # DeepSpeed picks NCCL, MPI (cuda_aware: GPU buffers straight to MPI) or HCCL here;
        # dsrun sends everything through dsrun.runtime.comm, whichever backend runs the job.
        self.cuda_aware = bool(cuda_aware)
        self.comm_backend_name = comm_backend_name
        self._errors: dict[tuple[int, int], list[torch.Tensor]] = {}

    def steps_done(self) -> int:
        """Optimizer steps taken (the step counter of the first stepped tensor)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            if "step" in self.state.get(p, {}):
                return int(self.state[p]["step"])
        return 0

    @abc.abstractmethod
    def gradients_averaged(self) -> bool:
        """True when the gradients of the coming step must arrive averaged
        over the ranks (the engine all-reduces them); False when each rank
        keeps its local gradients and `step()` communicates."""

    def world_size(self) -> int:
        return comm.get_world_size(self.comm_group)

    # ---- compression ---------------------------------------------------------------
    def _indexed(self):
        """(group index, tensor index, group, tensor) of every parameter."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                yield gi, pi, group, p

    def _stepped(self):
        """(group index, tensor index, group, tensor, its Adam state) of every
        parameter with a gradient, the state's step counter already advanced.

        Raises:
            ValueError: a sparse gradient (the compressed exchange needs dense ones).
        """
        for gi, pi, group, p in self._indexed():
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
            state = adam_state(self, p)
            state["step"] += 1
            yield gi, pi, group, p, state

    def compressed_mean(self, key: tuple[int, int], group: dict, p: torch.Tensor,
                        buffer: torch.Tensor) -> torch.Tensor:
        """The error-compensated 1-bit mean of `buffer` (fp32, p's shape) over
        the ranks, in place, masked (see [Note: momentum masks]). Collective."""
        flat = buffer.view(-1)
        errors = self._errors.get(key)
        if errors is None:
            n = flat.numel()
            errors = [torch.zeros(n, device=flat.device),
                      torch.zeros(server_chunk_numel(n, self.world_size()), device=flat.device)]
            self._errors[key] = errors
        compressed_all_reduce(flat, errors[0], errors[1], group=self.comm_group)
        state = self.state[p]
        buffer.mul_(state["exp_avg_sq"] != 0)
        mask = group.get("exp_avg_mask")
        if mask is not None:
            buffer.mul_(mask.to(buffer.device))
        return buffer

    def reset_errors(self) -> None:
        """Forget every worker and server error (they restart from zero)."""
        for errors in self._errors.values():
            for t in errors:
                t.zero_()

    # ---- checkpoints: see [Note: error buffers in checkpoints] --------------------------
    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """This rank's error buffers, keyed "g<group>.t<tensor>.worker_error" /
        ".server_error", plus what `_extra_tensors` adds."""
        out = {}
        for (gi, pi), (worker, server) in sorted(self._errors.items()):
            out[f"g{gi}.t{pi}.worker_error"] = worker
            out[f"g{gi}.t{pi}.server_error"] = server
        out.update(self._extra_tensors())
        return out

    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        """Rank-local tensors besides the error buffers (subclasses)."""
        return {}

    def replicated_extras(self) -> dict[str, torch.Tensor]:
        """Tensors every rank holds identically (subclasses; saved once per rank,
        restored from any rank's copy whatever the world size)."""
        return {}

    def load_replicated_extras(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore `replicated_extras()`."""

    def load_checkpoint_extras(self, saved: dict[str, torch.Tensor] | None) -> str:
        """Restore `checkpoint_extras()` of this rank (None: the checkpoint
        has none for this rank, e.g. another world size). Returns what was
        done, for the load message."""
        problem = "saved by another world size, or not saved" if saved is None else self._mismatch(saved)
        self._errors.clear()
        self._clear_extras()
        if problem:
            return f"error-feedback buffers restart from zero ({problem})"
        if not saved:
            return "the checkpoint holds no error-feedback buffers (saved before compression started)"
        self._restore(saved)
        return f"error-feedback buffers restored ({len(saved)} tensors of this rank)"

    def _mismatch(self, saved: dict[str, torch.Tensor]) -> str | None:
        """Why `saved` does not fit this optimizer's tensors, or None."""
        sizes = {}
        for gi, pi, _, p in self._indexed():
            n = p.numel()
            sizes[f"g{gi}.t{pi}.worker_error"] = n
            sizes[f"g{gi}.t{pi}.server_error"] = server_chunk_numel(n, self.world_size())
            sizes.update({f"g{gi}.t{pi}.{name}": n for name in self._extra_names()})
        for key, value in saved.items():
            if sizes.get(key) != value.numel():
                return f"{key} has {value.numel()} elements, this run expects {sizes.get(key)}"
        return None

    def _extra_names(self) -> tuple[str, ...]:
        """Names of the subclass's rank-local element-wise tensors."""
        return ()

    def _clear_extras(self) -> None:
        """Drop the subclass's rank-local tensors (they restart from zero)."""

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        params = {(gi, pi): p for gi, pi, _, p in self._indexed()}
        for key, value in saved.items():
            gpart, tpart, name = key.split(".", 2)
            index = (int(gpart[1:]), int(tpart[1:]))
            device = params[index].device
            if name in ("worker_error", "server_error"):
                errors = self._errors.setdefault(index, [None, None])
                errors[0 if name == "worker_error" else 1] = value.to(device, torch.float32).reshape(-1).clone()
            else:
                self._restore_extra(index, name, value.to(device))
        for index, errors in list(self._errors.items()):
            if any(t is None for t in errors):
                del self._errors[index]

    def _restore_extra(self, index: tuple[int, int], name: str, value: torch.Tensor) -> None:
        raise KeyError(f"unexpected checkpoint extra {name!r}")
