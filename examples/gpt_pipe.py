"""The byte GPT of gpt_model.py as a `PipelineModule`, for pipeline-parallel training.

Layers, in order (one argument in, one out, as a PipelineModule needs):

    0        TiedLayerSpec("embed", nn.Embedding)       (B, T) int64 -> (B, T, C)
    1        PositionEmbedding                           adds the learned positions, dropout
    2..n+1   Block (gpt_model.Block)                     (B, T, C) -> (B, T, C)
    n+2      nn.LayerNorm                                the final norm
    n+3      TiedLayerSpec("embed", forward_fn=logits)  (B, T, C) -> (B, T, 256) logits

The output projection is the token embedding's weight, as in GPT (Press &
Wolf 2017): with the two ends on different stages each holds a copy, and the
engine keeps them equal (it broadcasts the first stage's copy at start-up and
sums the two copies' gradients each step; see the pipeline module's
[Note: tied layers]). `lm_loss` is the module's loss_fn.

`load_gpt_weights` copies a `GPT`'s weights into this rank's layers, so a
pipeline run starts from exactly the weights the data-parallel run gets from
the same seed. `tensor_parallel_gpt_pipeline` builds the same pipeline with
each block's linear layers split over tensor-parallel ranks (pipeline x
tensor x data).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from gpt_model import GPT, Block, GPTConfig

TIED_KEY = "embed"


class PositionEmbedding(nn.Module):
    """Adds a learned embedding of each position, then dropout: (B, T, C) -> (B, T, C).

    Raises:
        ValueError: T exceeds seq_len.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.seq_len}")
        return self.drop(x + self.pos(torch.arange(T, device=x.device)))


def logits(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output projection with the token embedding's weight: (B, T, C) -> (B, T, vocab)."""
    return F.linear(x, embedding.weight)


def lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of (B, T, vocab) logits against (B, T) int64 targets."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def gpt_pipeline(cfg: GPTConfig, num_stages: int, partition_method: str = "parameters",
                 topology=None) -> PipelineModule:
    """The GPT's layers as a PipelineModule over `num_stages` stages (call after init_distributed);
    `topology`: the job's ProcessTopology when it has axes besides pipe and data.

    Raises:
        ValueError: num_stages does not divide the world size, or the model
            has fewer layers than stages (from PipelineModule).
    """
    layers = [
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd),
        LayerSpec(PositionEmbedding, cfg),
        *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd, forward_fn=logits),
    ]
    return PipelineModule(layers, num_stages=num_stages, topology=topology, loss_fn=lm_loss,
                          partition_method=partition_method)


def tensor_parallel_gpt_pipeline(gpt: GPT, num_stages: int, tp_size: int) -> PipelineModule:
    """`gpt` as a pipeline of `num_stages` stages whose blocks' linear layers
    are split over `tp_size` tensor-parallel ranks, the rest of the world
    data parallel (call after init_distributed, with the same `gpt` weights
    on every rank). Makes the pipe x model x data mesh current (collective),
    builds the pipeline on its topology, copies `gpt`'s weights and cuts
    this rank's slices with AutoTP's placement (qkv and fc column-parallel,
    the output projections row-parallel; see
    dsrun/runtime/parallel/tensor/autotp.py), which DeepSpeed's AutoTP does
    not apply to a PipelineModule.

    Raises:
        ValueError: num_stages x tp_size does not divide the world size, or
            tp_size does not divide the heads.
    """
    # dsrun's own modules, imported here: the rest of this file (and train_gpt.py
    # without this combination) also runs with DeepSpeed standing in for dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from dsrun.runtime.parallel.tensor.autotp import shard_model

    mesh = ParallelMesh.build(dist.get_world_size(), pipe=num_stages, model=tp_size)
    set_current(mesh)
    pipe = gpt_pipeline(gpt.cfg, num_stages, topology=mesh.topology)
    load_gpt_weights(pipe, gpt)
    return shard_model(pipe, mesh)


def load_gpt_weights(pipe: PipelineModule, gpt: GPT) -> None:
    """Copy `gpt`'s weights into the layers `pipe` holds on this rank (the
    layer order above; state_dict keys "{layer}.{name}" and
    "tied_modules.embed.weight").

    Raises:
        ValueError: the two models' shapes differ.
    """
    n = gpt.cfg.n_layer
    source = {f"tied_modules.{TIED_KEY}.weight": gpt.tok_emb.weight, "1.pos.weight": gpt.pos_emb.weight}
    for i, block in enumerate(gpt.blocks):
        source.update({f"{2 + i}.{name}": t for name, t in block.state_dict().items()})
    source.update({f"{n + 2}.{name}": t for name, t in gpt.ln_f.state_dict().items()})
    mine = pipe.state_dict()
    missing = sorted(set(mine) - set(source))
    if missing:
        raise ValueError(f"the GPT has no weights for the pipeline's {missing}: build both from the same GPTConfig")
    pipe.load_state_dict({key: source[key] for key in mine})


def param_groups(pipe: PipelineModule) -> list[dict]:
    """GPT.param_groups for this rank's layers: weight decay on tensors with >= 2 dims only."""
    params = list(pipe.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
