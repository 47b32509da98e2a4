"""A small decoder-only transformer (GPT) for byte-level language modelling.

The architecture follows GPT-2 as re-implemented by nanoGPT (karpathy/nanoGPT,
model.py): learned token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a 4x MLP, a final LayerNorm, and an output head
whose weight is the token embedding (weight tying, Press & Wolf 2017).
Attention uses ``F.scaled_dot_product_attention`` with ``is_causal=True``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Model shape.

    Attributes:
        vocab_size: number of token ids; 256 for raw bytes.
        seq_len: longest sequence the position embedding covers (tokens).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide n_embd.
        n_embd: width of the residual stream.
        dropout: dropout probability on attention, MLP and embeddings.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_head so that each head gets n_embd // n_head channels"
            )
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head  # this rank's heads under tensor parallelism (dsrun.tp_model_init)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) float -> (B, T, C) float."""
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, nh, T, hs)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, nh, T, hs) -> (B, T, nh * hs)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, width 4 * n_embd, GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer with the output head tied to the token embedding.

    ``forward(idx)`` returns logits; ``forward(idx, targets)`` returns the mean
    cross-entropy loss, so a training loop can call ``loss = engine(x, y)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (vocab, C) tensor
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch's output projection gets
        # std 0.02 / sqrt(2 * n_layer), so the residual stream's variance does
        # not grow with depth (two branches per block).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                curriculum_seqlen: int | None = None) -> torch.Tensor:
        """Run the model.

        Args:
            idx: (B, T) int64 token ids in [0, vocab_size), T <= seq_len.
            targets: optional (B, T) int64 next-token ids.
            curriculum_seqlen: train on the first curriculum_seqlen tokens of
                each window only (the engine passes it under a seqlen
                curriculum, as DeepSpeed's does to Megatron's GPT).

        Returns:
            (B, T, vocab_size) float logits when targets is None, else the
            scalar mean cross-entropy (nats per token).

        Raises:
            ValueError: T exceeds the position embedding's seq_len.
        """
        if curriculum_seqlen is not None:
            idx = idx[:, :curriculum_seqlen]
            targets = targets[:, :curriculum_seqlen] if targets is not None else None
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))

    def param_groups(self) -> list[dict]:
        """Split parameters for AdamW: decay matrices and embeddings, not biases or norms.

        Returns ``[{"params": <tensors with >= 2 dims>}, {"params": <the rest>,
        "weight_decay": 0.0}]``; the first group takes its weight decay from the
        optimizer's config. ``parameters()`` yields the tied head/embedding
        weight once, so it is updated once per step.
        """
        params = list(self.parameters())
        return [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
