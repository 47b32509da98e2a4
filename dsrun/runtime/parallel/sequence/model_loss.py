"""The engine's side of the token-averaged loss under sequence parallelism:
a model's own loss (a Hugging Face causal LM given `shift_labels`) turned
into the token mean over the sequence x data ranks (DeepSpeed issue #5248).

[Note: the engine averages a model's loss over tokens]
Under Ulysses a Hugging Face model given its rank's slice of `shift_labels`
returns the mean over that slice's counted tokens (labels other than
-100). DeepSpeed backpropagates that per-rank mean and averages the
gradients over ranks, which weighs a slice of 3 counted tokens as much as
one of 300; its users all-gather the losses and counts by hand. dsrun's
engine does it in forward: when sequence_parallel_size > 1, the forward was
given `shift_labels` (as a keyword or in a dict batch, as
UlyssesSPDataLoaderAdapter makes them) and the output carries a `loss`, the
loss is replaced by token_weighted_mean over the mesh's "sequence_data"
group, the ranks the engine averages gradients over. Its value is then the
mean over every counted token of the micro-batch on every data and
sequence rank (what an unsharded run on the same samples computes) and its
gradient, after the engine's division by data x sequence ranks, that
mean's gradient. Micro-batches of one accumulation are still weighed
equally (the engine's division by gradient_accumulation_steps). A loss
computed outside the model is left alone: use sequence_parallel_loss.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime.parallel.sequence.loss import token_weighted_mean

IGNORE_INDEX = -100  # the label of a token that does not count (torch's and Hugging Face's default)


def _field(container: Any, name: str) -> Any:
    if isinstance(container, Mapping):
        return container.get(name)
    return getattr(container, name, None)


def token_mean_of_model_loss(output: Any, inputs: tuple, kwargs: dict, group: ProcessGroup | None) -> Any:
    """`output` with its `loss` made the token mean over `group` (see
    [Note: the engine averages a model's loss over tokens]); `output`
    unchanged when the forward had no `shift_labels` or returned no loss.

    Args:
        output: the model's forward output: a mapping (a Hugging Face
            ModelOutput, a dict) or an object with a `loss` attribute.
        inputs, kwargs: the forward's arguments; `shift_labels` [b, n] (int,
            -100 for tokens that do not count) is looked up in kwargs, then
            in a single dict positional argument.
        group: the data x sequence group (None: this rank alone).

    Returns:
        `output`, its loss replaced in place (a mapping's item, or the
        attribute).

    Raises:
        ValueError: no rank of the group counts a token; this rank counts
            none and the output has no `logits` to carry a zero gradient.
    """
    labels = kwargs.get("shift_labels")
    if labels is None and len(inputs) == 1 and isinstance(inputs[0], Mapping):
        labels = inputs[0].get("shift_labels")
    loss = _field(output, "loss")
    if labels is None or not isinstance(loss, torch.Tensor):
        return output
    count = (labels != IGNORE_INDEX).sum()
    averaged = token_weighted_mean(loss, count, group, fallback=_field(output, "logits"))
    if isinstance(output, MutableMapping):
        output["loss"] = averaged
    else:
        output.loss = averaged
    return output
