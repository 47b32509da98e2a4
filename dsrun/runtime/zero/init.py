"""`zero.Init`: build a model with its parameters already partitioned.

Inside `with dsrun.zero.Init():` every parameter a module creates is, as
soon as that module's constructor returns, replaced by this rank's shard of
it: rank 0's value (broadcast, so every rank starts from the same
initialisation), zero-padded to a multiple of N, shard r = elements
[r*w, (r+1)*w), w = ceil(numel / N). The shard is kept in the parameter's
record (`ds_tensor`, see params.py) and the parameter's own storage is
freed, so the full model never exists on one rank: peak memory while
building is the shards plus the largest single module's parameters.

That shard is exactly this rank's shard of the parameter's bucket in the
stage-3 layout (one bucket per parameter, see stage3.py), so the stage-3
strategy adopts it without ever rebuilding full values. Stages 0-2 need
full values and get them back one parameter at a time (`restore_full`).

Parameters a constructor creates on the meta device (e.g. inside
`with torch.device("meta"):`) are materialized on this rank's device as
soon as their module's constructor returns, and initialised by that module's
`reset_parameters()` (every torch.nn layer has one); a module without one is
an error naming it, since its values would be uninitialised memory.

Limits (as in DeepSpeed): code that initialises weights of a sub-module
AFTER that sub-module was constructed (e.g. `self.apply(self._init_weights)`
at the end of the outer constructor) sees empty tensors; wrap it in
`GatheredParameters(..., modifier_rank=0)` or initialise inside the
sub-module's constructor.
"""
from __future__ import annotations

import functools

import torch

from dsrun.runtime import comm
from dsrun.runtime.dist import init_distributed
from dsrun.runtime.zero.params import ZeroParam, ZeroParamStatus, record_of
from dsrun.runtime.zero.partition import FlatLayout


def _all_subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def is_partitioned(param: torch.Tensor) -> bool:
    """True while `param` holds only its zero.Init shard (no strategy adopted it yet)."""
    rec = record_of(param)
    return rec is not None and rec.init_shard is not None


def _layout(shape, world: int) -> FlatLayout:
    """The one-parameter, one-bucket layout a zero.Init shard follows (the
    same as the parameter's bucket in the stage-3 layout)."""
    return FlatLayout.build([("", shape)], world, 1)


def partition_param(param: torch.nn.Parameter, group=None) -> None:
    """Replace `param`'s data by this rank's shard of rank 0's value (collective)."""
    if is_partitioned(param):
        return
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    layout = _layout(param.shape, world)
    with torch.no_grad():
        comm.broadcast(param.data, src=_global_rank0(group), group=group)  # every rank starts from rank 0's init
        shard = torch.zeros(layout.shard_numel, dtype=param.dtype, device=param.device)
        flat = param.data.reshape(-1)
        for piece in layout.local_pieces(rank):
            shard[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo].copy_(flat[piece.lo:piece.hi])
    rec = ZeroParam(param, param.shape)
    rec.init_shard, rec.init_world_size = shard, world
    param.ds_tensor = shard
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _global_rank0(group) -> int:
    import torch.distributed as dist
    return 0 if group is None else dist.get_global_rank(group, 0)


def gather_full(param: torch.nn.Parameter, group=None) -> torch.Tensor:
    """The full value of a zero.Init-partitioned parameter (collective), (ds_shape)."""
    rec = record_of(param)
    shard = rec.init_shard
    world = comm.get_world_size(group)
    if world != rec.init_world_size:
        raise ValueError(f"parameter was partitioned over {rec.init_world_size} ranks by zero.Init, "
                         f"now gathered over {world}; use the same data-parallel group")
    flat = torch.empty(_layout(rec.shape, world).padded_numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(flat, shard, group=group)  # one bucket: shards are rank-major
    return flat[:rec.numel].view(rec.shape)


def restore_full(param: torch.nn.Parameter, group=None) -> None:
    """Give a zero.Init parameter its full value back and drop its shard
    (collective; no-op for a parameter that is not partitioned)."""
    if is_partitioned(param):
        param.data = gather_full(param, group).clone()
        rec = record_of(param)
        rec.init_shard = None
        param.ds_status = ZeroParamStatus.AVAILABLE


def write_shard(param: torch.nn.Parameter, full: torch.Tensor, group=None) -> None:
    """Store this rank's shard of `full` (param's full shape) as param's shard."""
    rec = record_of(param)
    flat = full.reshape(-1)
    rec.init_shard.zero_()
    for piece in _layout(rec.shape, rec.init_world_size).local_pieces(comm.get_rank(group)):
        rec.init_shard[piece.shard_offset:piece.shard_offset + piece.hi - piece.lo].copy_(flat[piece.lo:piece.hi])


class Init:
    """Context manager: modules built inside have partitioned parameters.

    Accepts DeepSpeed's arguments; `data_parallel_group` selects the ranks
    (default all), `enabled=False` makes it a no-op, `dtype` casts the
    parameters before partitioning. Unlike DeepSpeed, a bf16/fp16 config
    does not cast them: shards keep the constructor's dtype, so the fp32
    master weights the strategy builds from them are the exact initial
    values (the strategy casts its compute copy itself). remote_device,
    pin_memory and config are accepted for compatibility and ignored: the
    strategy moves the partitions where `offload_param` says (see
    dsrun/runtime/offload/param_tier.py). Initialises torch.distributed
    when needed.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **_compat):
        self.group = data_parallel_group
        self.enabled = enabled
        self.dtype = dtype
        self._patched: list[tuple[type, object]] = []
        if module is not None and enabled:
            init_distributed()
            for p in module.parameters():
                self._partition(p)

    def _partition(self, p: torch.nn.Parameter) -> None:
        if self.dtype is not None and p.is_floating_point():
            p.data = p.data.to(self.dtype)
        partition_param(p, self.group)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self.device = init_distributed().device
        for cls in [torch.nn.Module] + _all_subclasses(torch.nn.Module):
            if "__init__" in cls.__dict__:
                self._patched.append((cls, cls.__dict__["__init__"]))
                cls.__init__ = self._wrap(cls.__dict__["__init__"])
        return self

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
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:  # a new Parameter: a meta tensor's data cannot be swapped for a real one
                real = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                setattr(module, name, torch.nn.Parameter(real, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(module, name, torch.zeros(b.shape, dtype=b.dtype, device=self.device))
        with torch.no_grad():
            reset()

    def _wrap(self, original):
        ctx = self

        @functools.wraps(original)
        def wrapper(module, *args, **kwargs):
            original(module, *args, **kwargs)
            # Only the most-derived constructor partitions: a subclass may
            # still initialise what its parent created.
            if type(module).__init__ is wrapper:
                ctx._materialize(module)
                for p in module.parameters(recurse=False):
                    ctx._partition(p)
        return wrapper

    def __exit__(self, *exc) -> None:
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
