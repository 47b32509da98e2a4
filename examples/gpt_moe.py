"""The byte GPT with Mixture-of-Experts MLPs in alternate blocks (train_gpt.py --moe_experts).

Blocks 1, 3, 5, ... replace their MLP by DeepSpeed's `MoE` layer (imported as
`deepspeed.moe.layer.MoE` is, from dsrun): E experts, each a copy of the
block's MLP (width 4 x n_embd), spread over `ep_size` expert-parallel ranks,
with top-k gating. With k = 1 a token passes through one expert, so the
model's active parameters per token are the dense GPT's plus the gates
(n_embd x E per MoE block). The training loss adds AUX_LOSS_COEF times the
sum of the layers' load-balancing losses (Switch Transformer's 0.01); the
validation loss (eval mode) is the cross-entropy alone, comparable with the
dense model's.

`moe_gpt_pipeline` is the same model as a PipelineModule
(configs/gpt_3d_moe.json: pipe x tensor x data, experts over the data ranks).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dsrun.moe.layer import MoE
from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from gpt_model import GPT, MLP, Block, GPTConfig
from gpt_pipe import TIED_KEY, PositionEmbedding, lm_loss, logits

AUX_LOSS_COEF = 0.01


class MoEMLP(nn.Module):
    """A block's MLP slot holding a MoE layer: (B, T, C) -> (B, T, C); the
    last forward's l_aux is kept in `l_aux` for the model's loss."""

    def __init__(self, cfg: GPTConfig, num_experts: int, ep_size: int, k: int) -> None:
        super().__init__()
        # min_capacity=4 as DeepSpeed's default; capacity factor 1.0 (k x 1.0 for k > 1)
        self.moe = MoE(cfg.n_embd, MLP(cfg), num_experts=num_experts, ep_size=ep_size, k=k)
        self.l_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


class MoEGPT(GPT):
    """GPT whose odd blocks' MLPs are MoEMLPs (see the module docstring).

    Raises:
        ValueError: num_experts < 1, k outside [1, num_experts], or ep_size
            not dividing num_experts (from MoE).
    """

    def __init__(self, cfg: GPTConfig, num_experts: int, ep_size: int = 1, k: int = 1) -> None:
        super().__init__(cfg)
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.moe_mlps = []
        for i, block in enumerate(self.blocks):
            if i % 2 == 1:
                block.mlp = MoEMLP(cfg, num_experts, ep_size, k)
                self.moe_mlps.append(block.mlp)
        # the new layers get GPT's init (normal(0, 0.02), scaled output projections)
        for name, p in self.named_parameters():
            if ".mlp.moe." in name:
                std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith("proj.weight") else 0.02
                if p.dim() >= 2:
                    nn.init.normal_(p, mean=0.0, std=std)
                else:
                    nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                curriculum_seqlen: int | None = None) -> torch.Tensor:
        """As GPT.forward; in training with targets, the loss plus
        AUX_LOSS_COEF x the MoE layers' l_aux."""
        out = super().forward(idx, targets, curriculum_seqlen)
        if targets is None or not self.training:
            return out
        return out + AUX_LOSS_COEF * sum(m.l_aux for m in self.moe_mlps)


# [Note: the auxiliary loss along the pipeline]
# A pipeline stage passes one value on, so MoE's load-balancing loss rides
# with the hidden states, as in DeepSpeed's pipeline models: from the
# position embedding on every layer maps (h, aux) to (h', aux'), an MoE block
# adding its l_aux in training (eval_batch puts the module in eval mode: the
# validation loss is the cross-entropy alone, as MoEGPT's), and the loss
# function adds AUX_LOSS_COEF x aux at the last stage.

class _AuxPositionEmbedding(PositionEmbedding):
    """(B, T, C) -> ((B, T, C), a zero auxiliary loss to add to)."""

    def forward(self, x: torch.Tensor):
        return super().forward(x), x.new_zeros(())


class _AuxBlock(Block):
    """A dense block on (h, aux): (Block(h), aux)."""

    def forward(self, inputs):
        h, aux = inputs
        return super().forward(h), aux


class _AuxMoEBlock(_AuxBlock):
    """A block whose MLP is an MoEMLP, on (h, aux): (Block(h), aux + l_aux in training)."""

    def __init__(self, cfg: GPTConfig, num_experts: int, ep_size: int, k: int) -> None:
        super().__init__(cfg)
        self.mlp = MoEMLP(cfg, num_experts, ep_size, k)

    def forward(self, inputs):
        h, aux = super().forward(inputs)
        return h, aux + self.mlp.l_aux if self.training else aux


class _AuxLayerNorm(nn.LayerNorm):
    def forward(self, inputs):
        h, aux = inputs
        return super().forward(h), aux


def _aux_logits(embedding: nn.Embedding, inputs):
    h, aux = inputs
    return logits(embedding, h), aux


def moe_lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """lm_loss of the (B, T, vocab) logits plus AUX_LOSS_COEF x the auxiliary loss carried along."""
    prediction, aux = out
    return lm_loss(prediction, targets) + AUX_LOSS_COEF * aux


def moe_gpt_pipeline(cfg: GPTConfig, num_stages: int, num_experts: int, ep_size: int = 1, k: int = 1,
                     topology=None):
    """MoEGPT's layers as a PipelineModule over `num_stages` stages, its
    blocks split evenly (call after init_distributed; its mesh's data axis
    holds the expert groups): gpt_pipe.gpt_pipeline's layers, the odd
    blocks' MLPs MoE layers, the auxiliary loss carried along (see [Note:
    the auxiliary loss along the pipeline]). Its state_dict keys are
    gpt_pipe.load_gpt_weights's, so a MoEGPT's weights load into it.
    `topology`: as gpt_pipe.gpt_pipeline's.

    Raises:
        ValueError: as gpt_pipe.gpt_pipeline and MoE.
    """
    layers = [
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd),
        LayerSpec(_AuxPositionEmbedding, cfg),
        *[LayerSpec(_AuxMoEBlock, cfg, num_experts, ep_size, k) if i % 2 else LayerSpec(_AuxBlock, cfg)
          for i in range(cfg.n_layer)],
        LayerSpec(_AuxLayerNorm, cfg.n_embd),
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd, forward_fn=_aux_logits),
    ]
    return PipelineModule(layers, num_stages=num_stages, topology=topology, loss_fn=moe_lm_loss,
                          partition_method="type:Block")
