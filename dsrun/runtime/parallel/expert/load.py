"""What a MoE layer's training forwards did since the last optimizer step:
tokens per expert, tokens dropped, the auxiliary loss, and whether the
backward reached that loss (read by watch.py)."""
from __future__ import annotations

import torch


class ExpertLoad:
    """Accumulates one MoE layer's routing over the training forwards of a step
    (training mode, outside a backward: activation checkpointing's
    recompute is not counted twice; see MOELayer.forward).

    Attributes:
        tokens: [E] int64 (CPU), token choices per expert before drops.
        kept: [E] int64 on the tokens' device (None before a forward),
            choices that found a slot; tokens - kept were dropped.
        aux_sum: sum of the forwards' l_aux (fp32 scalar; None before one).
        forwards: how many forwards were recorded.
        aux_pending: a forward's l_aux required grad and no backward has
            carried a gradient to it yet.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded (after a step reported it)."""
        self.tokens = torch.zeros(self.num_experts, dtype=torch.int64)
        self.kept: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None
        self.forwards = 0
        self.aux_pending = False

    def record(self, l_aux: torch.Tensor, exp_counts: torch.Tensor, kept: torch.Tensor) -> None:
        """Add one forward: its l_aux (scalar), exp_counts ([E] int64) and
        kept ([E] int64, the choices that found a slot). Hooks l_aux so that
        a backward through it clears `aux_pending`."""
        self.tokens += exp_counts
        self.kept = kept if self.kept is None else self.kept + kept
        aux = l_aux.detach().float()
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.forwards += 1
        if l_aux.requires_grad:
            self.aux_pending = True
            l_aux.register_hook(self._reached)

    def _reached(self, grad: torch.Tensor) -> None:
        self.aux_pending = False
