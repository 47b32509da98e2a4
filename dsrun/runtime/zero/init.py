"""`zero.Init`: build a model with its parameters already partitioned.

Inside `with dsrun.zero.Init():` every parameter a module creates is
replaced by this rank's shard of it: rank 0's value (broadcast, so every
rank starts from the same initialisation), zero-padded to a multiple of N,
shard r = elements [r*w, (r+1)*w), w = ceil(numel / N). The shard is kept in
the parameter's record (`ds_tensor`, see params.py) and the parameter's own
storage is freed, so the full model never exists on one rank.

That shard is exactly this rank's shard of the parameter's bucket in the
stage-3 layout (one bucket per parameter, see stage3.py), so the stage-3
strategy adopts it without ever rebuilding full values. Stages 0-2 need
full values and get them back one parameter at a time (`restore_full`).

[Note: where zero.Init builds]
Tensors are created where they will live, as in DeepSpeed: every tensor
factory call inside the context without a `device=` (torch.empty, zeros,
arange, ..., the ones nn layers use) builds on the backend's device -- the
Topology's device: cuda:LOCAL_RANK with NCCL, cpu with gloo -- so every
full value, gather and broadcast is on a device the backend can
communicate. The shard lives on that device too, unless `remote_device` is
"cpu" (host memory, page-locked when pin_memory and the accelerator can
pin) or "nvme" (see `Placement`). `dtype` casts each floating-point
parameter when it is registered, before its initialisation runs.

The model's own initialisation after a layer was built (`self.apply(...)`,
loops over `named_parameters()`, nn.init and in-place writes anywhere in a
constructor) is kept bit for bit: see [Note: writes under zero.Init] in
init_writes.py.

Parameters a constructor creates on the meta device (e.g. inside
`with torch.device("meta"):`) are materialized on the build device as soon
as their module's constructor returns, and initialised by that module's
`reset_parameters()` (every torch.nn layer has one); a module without one
is an error naming it, since its values would be uninitialised memory.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsrun.accelerator import get_accelerator
from dsrun.runtime import comm
from dsrun.runtime.config import offload_param_of
from dsrun.runtime.distributed.dist import init_distributed
from dsrun.runtime.zero.init_writes import Residency, WriteThroughMode
from dsrun.runtime.zero.params import ZeroParam, ZeroParamStatus, record_of
from dsrun.runtime.zero.partition import FlatLayout

_ACTIVE: list["Init"] = []  # the open (outermost) Init context, if any


@dataclass(frozen=True)
class Placement:
    """Where zero.Init puts a parameter (see [Note: where zero.Init builds]).

    build: where full values are created and every collective runs (the
        backend's device). shard: where this rank's shard lives. pin: the
        shard is page-locked host memory (asked for and the accelerator
        can pin). nvme: the shard waits in host memory for the engine's
        NVMe parameter tier.
    """

    build: torch.device
    shard: torch.device
    pin: bool = False
    nvme: bool = False


def choose_placement(remote_device: str | None, pin_memory: bool, build: torch.device,
                     offload_param_device: str | None = None) -> Placement:
    """The Placement for DeepSpeed's `remote_device`/`pin_memory` on a rank
    whose backend communicates on `build`.

    remote_device: None or "none" keeps the shard on `build`; "cpu" in host
    memory; "nvme" in host memory until the engine's NVMe parameter tier
    (zero_optimization.offload_param.device = "nvme") adopts it and writes
    it to its swap file -- dsrun has no swap file before the engine exists,
    so the shards of the model under construction are in host memory
    meanwhile (1/N of the model per rank). offload_param_device: the
    config's offload_param.device when Init got a config.

    Raises ValueError for an unknown remote_device, or "nvme" with a config
    whose offload_param.device is not "nvme" (the partition would have no
    NVMe tier to go to).
    """
    build = torch.device(build)
    kind = "none" if remote_device is None else str(remote_device).lower()
    if kind == "none":
        return Placement(build, build)
    if kind not in ("cpu", "nvme"):
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, 'none', 'cpu' or 'nvme'")
    if kind == "nvme" and offload_param_device not in (None, "nvme"):
        raise ValueError("zero.Init(remote_device='nvme') needs zero_optimization.offload_param.device='nvme' "
                         f"in its config (it is {offload_param_device!r}); without an NVMe parameter tier "
                         "use remote_device='cpu'")
    pin = bool(pin_memory) and build.type != "cpu"  # host memory is the device's own on a CPU rank
    return Placement(build, torch.device("cpu"), pin=pin, nvme=kind == "nvme")


def is_partitioned(param: torch.Tensor) -> bool:
    """True while `param` is a zero.Init parameter no strategy adopted yet
    (its values are in its shard, or in `.data` while resident/gathered)."""
    rec = record_of(param)
    return rec is not None and rec.init_shard is not None


def _layout(shape, world: int) -> FlatLayout:
    """The one-parameter, one-bucket layout a zero.Init shard follows (the
    same as the parameter's bucket in the stage-3 layout)."""
    return FlatLayout.build([("", shape)], world, 1)


def _global_rank0(group) -> int:
    import torch.distributed as dist
    return 0 if group is None else dist.get_global_rank(group, 0)


def partition_param(param: torch.nn.Parameter, placement: Placement, group=None) -> None:
    """Replace `param`'s full value by this rank's shard of rank 0's value
    (collective: a broadcast on placement.build). A parameter already
    partitioned and not holding its full value, or one ZeRO manages
    otherwise (a strategy adopted it), is left alone.

    Raises ValueError when a partitioned parameter's full value changed
    shape (its shard layout is fixed).
    """
    rec = record_of(param)
    if rec is not None and (rec.init_shard is None or not rec.init_full):
        return
    if rec is None:
        rec = ZeroParam(param, param.shape)
    elif tuple(param.shape) != tuple(rec.shape):
        raise ValueError(f"zero.Init: a parameter of shape {tuple(rec.shape)} was given a value of shape "
                         f"{tuple(param.shape)}; its partition cannot change shape")
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    layout = _layout(rec.shape, world)
    dtype = param.dtype
    with torch.no_grad():
        full = param.data.to(placement.build).contiguous()
        comm.broadcast(full, src=_global_rank0(group), group=group)  # every rank keeps rank 0's init
        shard = rec.init_shard
        if shard is None or shard.dtype != dtype or shard.numel() != layout.shard_numel:
            shard = torch.zeros(layout.shard_numel, dtype=dtype, device=placement.shard)
            if placement.pin:
                shard = get_accelerator().pin_memory(shard)
        flat = full.reshape(-1)
        for piece in layout.local_pieces(rank):
            shard[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo].copy_(flat[piece.lo:piece.hi])
    rec.init_shard, rec.init_world_size, rec.init_device, rec.init_full = shard, world, placement.build, False
    param.ds_tensor = shard
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.data = torch.empty(0, dtype=dtype, device=placement.build)


def gather_full(param: torch.nn.Parameter, group=None) -> torch.Tensor:
    """The full value of a zero.Init-partitioned parameter (collective), a
    new tensor of its ds_shape on the device it was built on (the shard is
    copied there first when it lives elsewhere, e.g. remote_device="cpu").

    Raises ValueError when `group` has another size than the one it was
    partitioned over.
    """
    rec = record_of(param)
    world = comm.get_world_size(group)
    if world != rec.init_world_size:
        raise ValueError(f"parameter was partitioned over {rec.init_world_size} ranks by zero.Init, "
                         f"now gathered over {world}; use the same data-parallel group")
    device = rec.init_device
    shard = rec.init_shard.to(device)
    flat = torch.empty(_layout(rec.shape, world).padded_numel, dtype=shard.dtype, device=device)
    comm.all_gather_into_tensor(flat, shard, group=group)  # one bucket: shards are rank-major
    return flat[:rec.numel].view(rec.shape)


def restore_full(param: torch.nn.Parameter, group=None) -> None:
    """Give a zero.Init parameter its full value back and drop its shard
    (collective; no-op for a parameter that is not partitioned)."""
    if is_partitioned(param):
        rec = record_of(param)
        if not rec.init_full:
            param.data = gather_full(param, group)
        rec.init_shard, rec.init_full = None, False
        param.ds_status = ZeroParamStatus.AVAILABLE


def write_shard(param: torch.nn.Parameter, full: torch.Tensor, group=None) -> None:
    """Store this rank's shard of `full` (param's full shape) as param's shard."""
    rec = record_of(param)
    flat = full.reshape(-1)
    rec.init_shard.zero_()
    for piece in _layout(rec.shape, rec.init_world_size).local_pieces(comm.get_rank(group)):
        rec.init_shard[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo].copy_(flat[piece.lo:piece.hi])


def open_full(params: list[torch.nn.Parameter], group=None) -> None:
    """GatheredParameters' entry for zero.Init parameters (collective): each
    gets a new tensor with its full value as `.data`. One resident in an
    open Init context is partitioned first, so its shard is current."""
    with torch._C.DisableTorchFunction():
        if _ACTIVE:
            _ACTIVE[0].residency.release(params)
        for p in params:
            p.data = gather_full(p, group)
            record_of(p).init_full = True
            p.ds_status = ZeroParamStatus.AVAILABLE


def close_full(params: list[torch.nn.Parameter], modified: bool, group=None) -> None:
    """GatheredParameters' exit for zero.Init parameters: keep the (already
    broadcast) values as the shards when `modified`, then give `.data` an
    empty tensor. The full tensor is only dropped, never resized: whoever
    still references it keeps a valid tensor."""
    with torch._C.DisableTorchFunction():
        for p in params:
            rec = record_of(p)
            if modified:
                write_shard(p, p.data, group)
            p.data = torch.empty(0, dtype=p.dtype, device=rec.init_device)
            rec.init_full = False
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _all_subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def resolve_remote(remote_device: str | None, pin_memory: bool, config) -> tuple[str | None, bool, str | None]:
    """(remote_device, pin_memory, the config's offload_param.device) that
    zero.Init uses: as in DeepSpeed, a config whose
    zero_optimization.offload_param.device is cpu or nvme decides both
    (the shards are built where the engine will keep them); otherwise the
    arguments do. config: None, a dict, a path or a DsConfig (only that
    section is read, see `offload_param_of`)."""
    if config is None:
        return remote_device, pin_memory, None
    section = offload_param_of(config)
    if section.device != "none":
        return section.device, section.pin_memory, section.device
    return remote_device, pin_memory, section.device


class Init:
    """Context manager: modules built inside have partitioned parameters.

    DeepSpeed's arguments (deepspeed.zero.Init):
        module: an already built module whose parameters to partition now.
        data_parallel_group: the ranks to partition over (default all).
        mem_efficient_linear: accepted; dsrun's linear layers need no patch.
        remote_device: None/"none", "cpu" or "nvme": where the shards live
            (see `choose_placement`); full values are always built on the
            backend's device, see [Note: where zero.Init builds].
        pin_memory: page-lock host shards (remote_device cpu/nvme, on an
            accelerator that can pin).
        config_dict_or_path, config: a ds_config; only
            zero_optimization.offload_param is read: its device (cpu or
            nvme) and pin_memory replace remote_device and pin_memory, as
            in DeepSpeed (see `resolve_remote`). Unlike DeepSpeed, a
            bf16/fp16 config does not cast the parameters: shards keep the
            constructor's dtype, so the fp32 master weights the strategy
            builds from them are the exact initial values (the strategy
            casts its compute copy itself).
        enabled: False makes the context a no-op.
        dtype: cast every floating-point parameter to it when registered,
            before its initialisation runs.
        mpu: accepted (model parallelism is not partitioned by zero.Init).
        zero_param_parallel_group, sequence_data_parallel_group: accepted;
            shards follow data_parallel_group (the engine's hpZ and
            sequence-parallel groups are set up by its config).
        zero_quantized_weights, zero_quantized_nontrainable_weights:
            accepted; the config's zero_optimization keys decide them when
            the engine adopts the shards.
        param_swapper: accepted; NVMe partitions are the engine's parameter
            tier's (see remote_device).

    Initialises torch.distributed when needed. An Init entered while another
    is open does nothing (the outer one partitions). Raises ValueError for
    a bad remote_device (see `choose_placement`), ConfigError (a
    ValueError) for an invalid offload_param section.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        self.group = data_parallel_group
        self.enabled = enabled
        self.dtype = dtype
        source = config if config is not None else config_dict_or_path
        self._remote = resolve_remote(remote_device, pin_memory, source if enabled else None)
        self._patched: list[tuple[type, object]] = []
        self._undo: list = []
        self._materializing = False
        self.placement: Placement | None = None
        self.residency = Residency(gather=self._gather, evict=self._evict)
        if module is not None and enabled:
            self.placement = self._placement()
            for p in module.parameters():
                self._cast(p)
                partition_param(p, self.placement, self.group)

    def _placement(self) -> Placement:
        remote, pin, offload = self._remote
        return choose_placement(remote, pin, init_distributed().device, offload)

    # ---- residency callbacks (collectives) --------------------------------
    def _gather(self, p: torch.nn.Parameter) -> None:
        p.data = gather_full(p, self.group)
        record_of(p).init_full = True
        p.ds_status = ZeroParamStatus.AVAILABLE

    def _evict(self, p: torch.nn.Parameter) -> None:
        partition_param(p, self.placement, self.group)

    def _cast(self, p: torch.nn.Parameter) -> None:
        if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
            p.data = p.data.to(self.dtype)

    # ---- context ---------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled or _ACTIVE:
            return self
        self.placement = self._placement()
        _ACTIVE.append(self)
        for cls in [torch.nn.Module] + _all_subclasses(torch.nn.Module):
            if "__init__" in cls.__dict__:
                self._patched.append((cls, cls.__dict__["__init__"]))
                cls.__init__ = self._wrap(cls.__dict__["__init__"])
        hook = torch.nn.modules.module.register_module_parameter_registration_hook(self._registered)
        device_ctx = torch.device(self.placement.build)  # default device of factory calls
        mode = WriteThroughMode(self.residency)
        device_ctx.__enter__()
        mode.__enter__()
        self._undo = [hook.remove, lambda: mode.__exit__(None, None, None),  # in this order
                      lambda: device_ctx.__exit__(None, None, None)]
        return self

    def _registered(self, module, name, param) -> None:
        """Module parameter registration hook: a new parameter becomes the
        resident one (the previous ones are partitioned)."""
        if param is None or record_of(param) is not None or param.is_meta or self._materializing:
            return  # tied / already managed; meta ones wait for their constructor's end
        with torch._C.DisableTorchFunction():
            self._cast(param)
        self.residency.admit([param], fresh=True)

    def _materialize(self, module: torch.nn.Module) -> None:
        """Give `module`'s own meta parameters storage and initial values
        (see the module docstring). Raises ValueError when it has no
        reset_parameters()."""
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            names = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
            raise ValueError(
                f"zero.Init: {type(module).__name__} created parameters {names} on the meta device and has "
                "no reset_parameters() to initialise them; create them on a real device inside zero.Init "
                "(its shards never hold the whole model anyway), or give the module reset_parameters()")
        fresh = []
        self._materializing = True
        try:
            with torch._C.DisableTorchFunction():
                for name, p in list(module.named_parameters(recurse=False)):
                    if p.is_meta:  # a new Parameter: a meta tensor's data cannot be swapped for a real one
                        dtype = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
                        real = torch.empty(p.shape, dtype=dtype, device=self.placement.build)
                        setattr(module, name, torch.nn.Parameter(real, requires_grad=p.requires_grad))
                        fresh.append(getattr(module, name))
                for name, b in list(module.named_buffers(recurse=False)):
                    if b.is_meta:
                        setattr(module, name, torch.zeros(b.shape, dtype=b.dtype, device=self.placement.build))
        finally:
            self._materializing = False
        self.residency.admit(fresh, fresh=True)
        with torch.no_grad():
            reset()

    def _wrap(self, original):
        ctx = self

        @functools.wraps(original)
        def wrapper(module, *args, **kwargs):
            original(module, *args, **kwargs)
            # Only the most-derived constructor: a subclass may still
            # initialise what its parent created.
            if type(module).__init__ is wrapper:
                ctx._materialize(module)
                # Parameters put into _parameters without registration hooks.
                unseen = [p for p in module.parameters(recurse=False)
                          if record_of(p) is None and not ctx.residency.holds(p)]
                if unseen:
                    with torch._C.DisableTorchFunction():
                        for p in unseen:
                            ctx._cast(p)
                    ctx.residency.admit(unseen, fresh=True)
        return wrapper

    def __exit__(self, exc_type, *exc) -> None:
        if not self._undo:
            return
        try:
            if exc_type is None:
                self.residency.release()  # every parameter partitioned when the context closes
        finally:
            for undo in self._undo:
                undo()
            self._undo = []
            for cls, original in reversed(self._patched):
                cls.__init__ = original
            self._patched.clear()
            _ACTIVE.remove(self)
