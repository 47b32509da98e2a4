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

`sequence_parallel_pipeline(pipe)` does the same to gpt_pipe.py's
PipelineModule on the mesh `dsrun.init_distributed(config=...)` declared
(pipe x tensor x sequence from one config, train_gpt.py with
configs/gpt_4d.json): Ulysses attention in every block of the stage, the
positions of this rank's slice, the token-mean loss over the sequence
ranks; `shard_window` is the engine's batch function that keeps this
rank's slice of each (windows, targets) micro-batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dsrun
from dsrun.runtime.parallel.mesh import ParallelMesh, current, set_current
from dsrun.sequence import sequence_parallel_loss, shard_sequence
from dsrun.sequence.layer import DistributedAttention
from gpt_model import GPT, Block, CausalSelfAttention
from gpt_pipe import PositionEmbedding


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
        return self.resid_drop(self.proj(y.reshape(B, T, -1)))  # -1: this tensor rank's heads


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


class SlicePositionEmbedding(PositionEmbedding):
    """PositionEmbedding of this sequence rank's slice: (B, T/P, C) -> (B, T/P, C),
    positions rank * T/P ... (the tokens' places in the whole window)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        start = current().rank("sequence") * n
        if start + n > self.seq_len:
            raise ValueError(f"sequence of {start + n} tokens is longer than seq_len={self.seq_len}")
        return self.drop(x + self.pos(torch.arange(start, start + n, device=x.device)))


def sequence_lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy's token mean over the sequence ranks of
    (B, T/P, vocab) logits against this rank's (B, T/P) int64 targets."""
    per_token = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1), reduction="none")
    return sequence_parallel_loss(per_token)


def shard_window(batch):
    """A pipeline micro-batch (windows, targets), each (B, T), cut to this
    sequence rank's (B, T/P) slices (PipelineEngine.set_batch_fn)."""
    windows, targets = batch
    return shard_sequence(windows, 1), shard_sequence(targets, 1)


def sequence_parallel_pipeline(pipe):
    """Make gpt_pipe.py's PipelineModule train with Ulysses over the current
    mesh's sequence axis (declared before, e.g. by
    dsrun.init_distributed(config=...)), in place: see the module's
    docstring. The engine's batch function must be `shard_window`.

    Raises:
        ValueError: the sequence axis does not divide the blocks' heads.
    """
    mesh = current()
    group = mesh.group("sequence")
    for layer in pipe.modules():
        if isinstance(layer, Block):
            if layer.attn.n_head % mesh.size("sequence"):
                raise ValueError(f"{mesh.size('sequence')} sequence-parallel ranks do not divide the "
                                 f"{layer.attn.n_head} heads of a block")
            layer.attn.__class__ = UlyssesSelfAttention
            layer.attn.ulysses = DistributedAttention(_local_attention, group)
        elif type(layer) is PositionEmbedding:
            layer.__class__ = SlicePositionEmbedding
    pipe.loss_fn = sequence_lm_loss
    return pipe
