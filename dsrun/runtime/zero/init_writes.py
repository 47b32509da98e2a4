"""The model's own initialisation under zero.Init, exact to the bit.

[Note: writes under zero.Init]
A model's constructor does not only create parameters: it initialises them,
often long after the layer that owns them was built -- GPT-2, nanoGPT and
Hugging Face's `post_init` call `self.apply(self._init_weights)` at the end
of the outer `__init__`, then loop over `self.named_parameters()` to rescale
some (nanoGPT: `c_proj.weight ~ N(0, 0.02 / sqrt(2 * n_layer))`), and any
constructor may write `p.data.mul_(...)`, `nn.init.zeros_(p)` or
`with torch.no_grad(): p.copy_(...)`. DeepSpeed gathers around
`Module.apply` only, so the other writes land in empty tensors and are lost.

dsrun keeps every write by making the parameters "write-through" while the
Init context is open: a `TorchFunctionMode` sees every torch call (tensor
methods, `nn.init.*`, `.data` reads and writes, factory functions) and,
before a call that reads or writes the VALUES of a partitioned parameter,
makes that parameter *resident*: its full value is all-gathered from the
shards into its `.data`, the call runs on it unchanged, and the parameter
stays resident until a call touches a parameter that is not (or a new
parameter is registered, or the context exits). Then it is *evicted*:
rank 0's full value is broadcast (every rank holds rank 0's
initialisation, as before), this rank keeps its shard and `.data` becomes
empty again.

Why this is bit-exact against the eager model: every rank runs the same
constructor code, so every rank executes the same calls in the same order
on the same full-shaped tensors -- `normal_` on a (V, C) embedding draws
the same V*C numbers from the same generator as in the eager model, at the
same point of the stream. Nothing is reordered (a layer's
`reset_parameters()` still runs inside its constructor, the outer
`apply`/loops after it) and nothing is drawn twice, so the RNG stream, and
with it every value, equals eager order. Gathers and broadcasts copy bits.
Rank 0's values are kept, so ranks seeded alike hold exactly rank 0's eager
model.

Memory: at most the parameters of one call are resident (usually one;
two for `p.copy_(q)`), plus the parameter being created and the
collectives' buffers, so the construction peak is the shards plus a few of
the largest parameters, never the model (measured, 16 x Linear(2048, 2048)
on 2 gloo ranks: peak RSS 172 MiB, of which 128 MiB shards; eager 256 MiB;
tests/zero/test_zero_init.py). The price is collectives while building:
a parameter written after others were touched is gathered and broadcast
again, one parameter at a time (the 85M GPT of examples/gpt_model.py on 2
gloo ranks, 1 thread each: built in 17.3 s with a 203 MiB peak per rank,
eagerly in 9.3 s with 357 MiB; bench/memory/zero_init_build.py). Shape queries (`p.shape`, `p.size()`, `p.dim()`,
`p.numel()`) are answered from the record without a gather, and calls that
need no values (`p.dtype`, `p.device`, `p.requires_grad_()`) pass through.

Collectives: residency changes only at calls every rank makes, so every
rank issues the same gathers and broadcasts in the same order (the usual
SPMD requirement on model code under zero.Init, as in DeepSpeed).

Limit: a tensor taken out of a resident parameter (`w = p.data`, a view
`p[0]`) stays linked to the parameter only while it is resident; a write
through `w` after another parameter was touched is not seen by the shards.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from dsrun.runtime.zero.params import record_of

Tensor = torch.Tensor

# Calls answered from the full shape alone (run on a meta stand-in).
_SHAPE_ONLY = {Tensor.shape.__get__, Tensor.ndim.__get__, Tensor.dim, Tensor.size, Tensor.numel,
               Tensor.nelement, Tensor.__len__}
# Calls that read no values: they run on the empty `.data` as they are.
_NO_VALUES = {Tensor.dtype.__get__, Tensor.device.__get__, Tensor.requires_grad.__get__,
              Tensor.requires_grad.__set__, Tensor.requires_grad_, Tensor.is_leaf.__get__,
              Tensor.grad.__get__, Tensor.layout.__get__, Tensor.is_floating_point,
              Tensor.is_complex, Tensor.element_size, Tensor.is_meta.__get__, Tensor.is_cuda.__get__,
              Tensor.get_device}


def is_sharded(t: object) -> bool:
    """True for a zero.Init parameter whose `.data` holds no values now
    (only its shard does)."""
    rec = record_of(t) if isinstance(t, Tensor) else None
    return rec is not None and rec.init_shard is not None and not rec.init_full


class Residency:
    """The zero.Init parameters whose full values are in `.data` now (see
    [Note: writes under zero.Init]).

    gather(p): fill p.data with its full value from the shards (collective).
    evict(p): partition p again, keeping rank 0's value (collective).
    Both run with torch functions disabled, so this mode does not see them.
    """

    def __init__(self, gather: Callable[[torch.nn.Parameter], None],
                 evict: Callable[[torch.nn.Parameter], None]):
        self._gather = gather
        self._evict = evict
        self.resident: list[torch.nn.Parameter] = []  # strong refs: eviction order must not depend on GC

    def holds(self, t: Tensor) -> bool:
        return any(t is r for r in self.resident)

    def admit(self, params: list[torch.nn.Parameter], fresh: bool = False) -> None:
        """Make exactly `params` resident: evict every other resident one
        first (so memory is freed before the gather), then gather those
        that are sharded. fresh: the params were just created and hold
        their full value already (no gather)."""
        with torch._C.DisableTorchFunction():
            keep = [r for r in self.resident if any(r is p for p in params)]
            for r in self.resident:
                if not any(r is k for k in keep):
                    self._evict(r)
            self.resident = keep
            for p in params:
                if self.holds(p):
                    continue
                if not fresh:
                    self._gather(p)
                self.resident.append(p)

    def release(self, params: list[torch.nn.Parameter] | None = None) -> None:
        """Evict `params` (default: all resident ones) now."""
        with torch._C.DisableTorchFunction():
            drop = self.resident if params is None else [r for r in self.resident if any(r is p for p in params)]
            for r in drop:
                self._evict(r)
            self.resident = [r for r in self.resident if not any(r is d for d in drop)]


class WriteThroughMode(TorchFunctionMode):
    """The TorchFunctionMode of [Note: writes under zero.Init]: before a call
    on a sharded parameter's values, makes the call's parameters resident."""

    def __init__(self, residency: Residency):
        super().__init__()
        self.residency = residency

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        sharded = [t for t in tensors if is_sharded(t)]
        if sharded and func not in _NO_VALUES:
            if func in _SHAPE_ONLY and len(args) >= 1 and args[0] is sharded[0] and len(sharded) == 1:
                rec = record_of(args[0])
                stand_in = torch.empty(rec.shape, dtype=args[0].dtype, device="meta")
                return func(stand_in, *args[1:], **kwargs)
            # Keep the resident tensors this call also uses; everything else may go.
            needed = [t for t in tensors if is_sharded(t) or self.residency.holds(t)]
            self.residency.admit(needed)
        return func(*args, **kwargs)
