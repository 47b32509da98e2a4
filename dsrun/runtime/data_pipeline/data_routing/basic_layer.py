"""`RandomLayerTokenDrop`: a layer that, while training, runs on a random subset of the tokens.

[Note: random-LTD]
Random-LTD (Yao et al. 2022, §3.1) skips part of the computation of the
middle layers of a transformer: each dropping layer draws, for every sample
of the micro-batch, `reserved_length` of the sequence's positions uniformly
without replacement, runs on those tokens only (in their original order),
and writes its outputs back to those positions. The other tokens bypass the
layer unchanged, as if it were the identity for them, and reach the next
layer, which draws anew: every token is processed by some layers, unlike
dropping tokens once for the whole network. The number kept grows over
training (scheduler.py) until it equals the sequence length; evaluation
always runs on every token.

Gradients follow the same split: a kept token's input gets the gradient
through the layer, a dropped token's input the gradient of its output as
it is (the bypass is an identity), and the layer's weights only what the
kept tokens give them.

Differences from DeepSpeed's `basic_layer.py`: each layer draws its own
positions when it runs (DeepSpeed draws every layer's at the first dropping
layer, with a CUDA sort kernel; the distribution is the same), extra
positional arguments are passed through, and a mask named by
`model_mask_name` but absent from the call is an error instead of a
KeyError deep inside.
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler


def sample_kept_positions(batch: int, seq_len: int, kept: int, device: torch.device) -> torch.Tensor:
    """`kept` distinct positions of `seq_len` per sample, uniformly at random, in increasing order.

    Uses torch's global random generator (as DeepSpeed's `torch.multinomial`).

    Returns:
        (batch, kept) int64 tensor on `device`.
    """
    scores = torch.rand(batch, seq_len, device=device)
    return scores.topk(kept, dim=1).indices.sort(dim=1).values


def _token_index(positions: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """positions (B, r) -> a gather/scatter index shaped like the kept part of `hidden`."""
    if batch_first:
        return positions[:, :, None].expand(-1, -1, hidden.size(2))  # (B, r, H)
    return positions.t()[:, :, None].expand(-1, -1, hidden.size(2))  # (r, B, H)


def gather_tokens(hidden: torch.Tensor, positions: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens of `hidden` ((B, S, H) or (S, B, H)) at `positions` (B, r):
    (B, r, H) or (r, B, H), differentiable."""
    return hidden.gather(1 if batch_first else 0, _token_index(positions, hidden, batch_first))


def scatter_tokens(hidden: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor,
                   batch_first: bool) -> torch.Tensor:
    """A copy of `hidden` with `kept` (the layer's outputs for the kept tokens,
    cast to `hidden`'s dtype: under autocast they may differ) written at
    `positions`; every other token is `hidden`'s. Differentiable in both."""
    return hidden.scatter(1 if batch_first else 0, _token_index(positions, hidden, batch_first), kept.to(hidden.dtype))


def slice_mask(mask: torch.Tensor, positions: torch.Tensor, seq_len: int, model_type: str) -> torch.Tensor:
    """The attention mask of the kept tokens `positions` (B, r) of a sequence of `seq_len`.

    decoder: `mask[..., :r, :r]` (DeepSpeed's rule). For a causal mask this
    is exact: the kept tokens stay in order, so token i of the kept sequence
    may attend to kept tokens 0..i, which is the causal mask of length r.
    It is not right for a mask that also hides padding per sample; declare
    such a model an encoder.

    encoder: the rows and columns of each sample's kept positions, for a
    mask of shape (B or 1, heads or 1, S or 1, S or 1) or a padding mask
    (B, S). Works for boolean and additive masks alike.

    Raises:
        ValueError: an encoder mask of another shape.
    """
    batch, kept = positions.shape
    if model_type == "decoder":
        return mask[..., :kept, :kept]
    if mask.dim() == 2 and mask.shape == (batch, seq_len):
        return mask.gather(1, positions)
    if mask.dim() != 4 or mask.size(0) not in (1, batch):
        raise ValueError(f"random-LTD (model_type encoder) needs the attention mask as (batch, heads, seq, seq) "
                         f"with batch and heads possibly 1, or (batch, seq); got shape {tuple(mask.shape)} "
                         f"for batch {batch} and sequence length {seq_len}")
    mask = mask.expand(batch, *mask.shape[1:])
    if mask.size(2) == seq_len:
        mask = mask.gather(2, positions[:, None, :, None].expand(-1, mask.size(1), -1, mask.size(3)))
    if mask.size(3) == seq_len:
        mask = mask.gather(3, positions[:, None, None, :].expand(-1, mask.size(1), mask.size(2), -1))
    return mask


class RandomLayerTokenDrop(torch.nn.Module):
    """A layer wrapped for random-LTD (DeepSpeed's class name; see [Note: random-LTD]).

    Built by `convert_to_random_ltd`; it drops nothing until `init_config`
    gives it a scheduler (the engine does, for the layers the config lists):
    until then, in eval mode, and once the schedule keeps the whole
    sequence, `forward` is the wrapped layer's.

    Args:
        layer: the wrapped layer. Its forward takes the hidden states first
            ((batch, seq, hidden) or (seq, batch, hidden), per the config's
            hidden_state_order) and returns a tensor of the same layout or a
            tuple whose first element is one.

    Attributes:
        random_ltd_layer: the wrapped layer (state-dict keys gain
            ".random_ltd_layer"; `remove_random_ltd_state_dict` drops it).
        random_ltd_scheduler: the shared scheduler, or None.
        random_ltd_layer_id: this layer's place among the dropping layers.
        reserved_length: tokens kept by the last forward (-1 before one).
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.reserved_length = -1
        self.mask_name: str | None = None
        self.model_type = "decoder"
        self.batch_first = True

    def init_config(self, scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        """Make this layer drop tokens, as many as `scheduler` says, with the
        mask and layout of the scheduler's random_ltd section (DeepSpeed's
        method, which takes the section as a first argument)."""
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.mask_name = scheduler.random_ltd.model_mask_name
        self.model_type = scheduler.random_ltd.model_type
        self.batch_first = scheduler.random_ltd.hidden_state_order == "batch_seq_dim"

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped layer on the kept tokens (training) or on all (eval).

        Raises:
            ValueError: `hidden_states` is not 3-dimensional; the config names
                a mask (model_mask_name) that the call does not pass by keyword.
            TypeError: the layer returns neither a tensor nor a tuple
                starting with one.
        """
        if self.random_ltd_scheduler is None or not self.training:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        if hidden_states.dim() != 3:
            layout = "batch, seq, hidden" if self.batch_first else "seq, batch, hidden"
            raise ValueError(f"random-LTD needs hidden states of 3 dimensions ({layout}, per hidden_state_order), "
                             f"got shape {tuple(hidden_states.shape)}")
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        seq_len = hidden_states.size(seq_dim)
        self.reserved_length = min(self.random_ltd_scheduler.get_current_seq(), seq_len)
        if self.reserved_length >= seq_len:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        positions = sample_kept_positions(hidden_states.size(batch_dim), seq_len, self.reserved_length,
                                          hidden_states.device)
        if self.mask_name is not None:
            if kwargs.get(self.mask_name) is None:
                raise ValueError(f"random_ltd.model_mask_name is '{self.mask_name}' but the layer was called "
                                 f"without {self.mask_name}=...; pass the mask by keyword, or set model_mask_name "
                                 "to null when the layer takes none")
            kwargs[self.mask_name] = slice_mask(kwargs[self.mask_name], positions, seq_len, self.model_type)
        outputs = self.random_ltd_layer(gather_tokens(hidden_states, positions, self.batch_first), *args, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, positions, self.batch_first)
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor):
            return (scatter_tokens(hidden_states, outputs[0], positions, self.batch_first), *outputs[1:])
        raise TypeError(f"random-LTD needs the wrapped layer ({type(self.random_ltd_layer).__name__}) to return "
                        f"the hidden states or a tuple starting with them, got {type(outputs).__name__}")
