"""The byte GPT of gpt_model.py under Ulysses sequence parallelism
(train_gpt.py --sequence_parallel P).

`sequence_parallel_gpt(model, P)` makes the data x sequence mesh current
and changes the model in place, keeping its parameters and their names (so
checkpoints and weights are those of the plain GPT):

- each CausalSelfAttention runs its attention through
  dsrun.sequence.layer.DistributedAttention over the mesh's sequence group:
  q, k and v of this rank's T/P tokens go to all T tokens of n_head/P heads
  in one all-to-all, causal attention runs there, the output comes back;
- the GPT takes the whole windows it was given (the P ranks of one replica
  draw the same ones), keeps its slice of the tokens (shard_sequence), adds
  the position embeddings of the tokens' places in the whole window, and
  returns the token mean of the loss over the P slices
  (sequence_parallel_loss), which is the plain GPT's loss on the window.

The training loop and evaluation of train_gpt.py do not change. The model
is still the plain GPT class underneath (the classes are subclasses), so
`isinstance(model, GPT)` holds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dsrun
from dsrun.runtime.parallel.mesh import ParallelMesh, current, set_current
from dsrun.sequence import sequence_parallel_loss, shard_sequence
from dsrun.sequence.layer import DistributedAttention
from gpt_model import GPT, CausalSelfAttention


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """Causal attention on [B, T, heads, hs] (the whole window, some heads)."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, dropout_p=dropout)
    return y.transpose(1, 2)


class UlyssesSelfAttention(CausalSelfAttention):
    """CausalSelfAttention whose attention is Ulysses attention (set
    `ulysses`, a DistributedAttention, before use)."""

    ulysses: DistributedAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T/P, C) float, this rank's tokens -> (B, T/P, C) float."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)  # (B, T/P, nh, hs)
        y = self.ulysses(q, k, v, 0, self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.reshape(B, T, C)))


class SequenceParallelGPT(GPT):
    """GPT that keeps its sequence rank's slice of every window."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Args and returns as GPT.forward, for the whole (B, T) windows;
        logits are this rank's (B, T/P, vocab) slice, the loss the mean over
        all T tokens (the same on the P ranks).

        Raises:
            ValueError: T exceeds seq_len, or P does not divide T.
        """
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        mine = shard_sequence(idx, 1)
        pos = shard_sequence(torch.arange(T, device=idx.device), 0)  # places in the whole window
        x = self.drop(self.tok_emb(mine) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T/P, vocab)
        if targets is None:
            return logits
        per_token = F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, 1).flatten(), reduction="none")
        return sequence_parallel_loss(per_token)


def sequence_parallel_gpt(model: GPT, sequence: int) -> GPT:
    """Make `model` train with Ulysses over `sequence` ranks (in place; see
    the module's docstring). Initialises torch.distributed and makes the data
    x sequence mesh current (collective: every rank calls it); pass
    `mesh_param=(world // sequence, sequence)` to dsrun.initialize.

    Raises:
        ValueError: `sequence` does not divide the world size or the GPT's
            n_head.
    """
    dsrun.init_distributed()
    world = dsrun.comm.get_world_size()
    if world % sequence or model.cfg.n_head % sequence:
        raise ValueError(f"--sequence_parallel {sequence} must divide the world size ({world}) and "
                         f"--n_head ({model.cfg.n_head})")
    set_current(ParallelMesh.build(world, sequence=sequence))
    group = current().group("sequence")
    for block in model.blocks:
        block.attn.__class__ = UlyssesSelfAttention
        block.attn.ulysses = DistributedAttention(_local_attention, group)
    model.__class__ = SequenceParallelGPT
    return model
