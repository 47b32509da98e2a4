"""Random numbers inside tensor-parallel regions (Megatron-LM's
`get_cuda_rng_tracker().fork()` around attention dropout).

[Note: dropout in tensor-parallel regions]
Between a ColumnParallelLinear (its output split by features) and the next
RowParallelLinear, each model rank holds different activations: its own
attention heads, its own MLP features. A dropout there (attention dropout on
the split heads) must draw a different mask on each model rank, or the
ranks' heads are dropped alike and the model is not the unsharded one.
Everywhere else the activations are replicated (after a row layer's
all-reduce: the residual stream, LayerNorm, embedding dropout), and every
model rank must draw the same mask. Megatron runs the split-region dropout
under the model-parallel RNG state (seeded by
`model_parallel_cuda_manual_seed` with seed + 2718 + model rank) and the
rest under the default generator, seeded alike on every rank.

The layers here do this without the model's code knowing it: a training
ColumnParallelLinear whose output stays split (no gather_output) swaps the
accelerator's default generator (the CPU generator on the CPU) for the
tracker's model-parallel state as it returns (`enter_split_region`), and
the next RowParallelLinear swaps it back before it computes
(`leave_split_region`), storing what the model-parallel state advanced to.
So HF GPT-2's and Llama's attention dropout, and the byte GPT's, draw from
the per-rank state, and the residual dropout after the row layer draws from
the default generator exactly as if the split region had drawn nothing from
it. Nothing changes until `model_parallel_cuda_manual_seed` (or the
tracker's `add`) created the model-parallel state: then all ranks draw
alike, as before. A region is entered once (q, k and v layers in a row) and
left by the first row layer; activation checkpointing
(dsrun.checkpointing.checkpoint) replays the tracker's states in its
recomputation, so the recomputed masks are the forward's. A region still
open when a forward ends (a column layer with no row layer after it, an
exception in between) is closed by the next VocabParallelEmbedding, row
layer, vocab_parallel_cross_entropy or gathering column layer.

Sequence parallelism (Korthikanti et al. 2022) splits the activations
outside those regions too: between a row layer's reduce-scatter and the
next column layer's all-gather each rank holds its own tokens, and the
residual and embedding dropout there must draw a different mask per rank
(Megatron forks the tracker around them when sequence_parallel is set).
So the sequence-parallel region is a split region as well: it is entered
by `scatter_to_sequence_region` (the model's own entry, e.g. after a
replicated embedding) and, in training, by the reduce-scatter of a
sequence-parallel RowParallelLinear or VocabParallelEmbedding (such a row
layer does not leave the region: its input and its output are both
split); it is left by `gather_from_sequence_region(..., reduce_grads=False)`
(the model's exit to replicated activations, before its output layer),
a gathering ColumnParallelLinear, or any of the above. A sequence-parallel
model therefore draws all its dropout masks between its entry and its exit
from the model-parallel state, and the default generator continues after
the exit as if nothing had been drawn.
"""
from __future__ import annotations

import torch

from dsrun.accelerator import get_accelerator
from dsrun.runtime.activation_checkpointing.checkpointing import MODEL_PARALLEL_RNG, get_cuda_rng_tracker


class _Region:
    """The default generator's state stashed while inside a split region
    (None: outside)."""

    outside: torch.Tensor | None = None


def enter_split_region() -> bool:
    """Draw from the tracker's model-parallel state from now on (no-op when
    already inside a region or the state was never created). Returns
    whether a region was entered."""
    tracker = get_cuda_rng_tracker()
    if _Region.outside is not None or MODEL_PARALLEL_RNG not in tracker.states:
        return False
    acc = get_accelerator()
    _Region.outside = acc.get_rng_state()
    acc.set_rng_state(tracker.states[MODEL_PARALLEL_RNG])
    return True


def leave_split_region() -> bool:
    """Back to the default generator where it was when the region was
    entered, keeping the model-parallel state's advance (no-op outside a
    region). Returns whether a region was left."""
    if _Region.outside is None:
        return False
    acc = get_accelerator()
    tracker = get_cuda_rng_tracker()
    if MODEL_PARALLEL_RNG in tracker.states:
        tracker.states[MODEL_PARALLEL_RNG] = acc.get_rng_state()
    acc.set_rng_state(_Region.outside)
    _Region.outside = None
    return True


def in_split_region() -> bool:
    """Whether random draws now come from the model-parallel state."""
    return _Region.outside is not None
