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
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dsrun.moe.layer import MoE
from gpt_model import GPT, MLP, GPTConfig

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
