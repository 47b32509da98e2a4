"""The engine's view of a model's MoE layers: a warning when a training
step's backward never reached a layer's auxiliary loss, and the per-layer
expert load for the monitors.

[Note: MoE in the monitors]
After every optimizer step, while a monitor is on, each MoE layer reports
(x = samples so far, as every Train/Samples event):

- Train/MoE/<layer>/l_aux: the mean auxiliary loss over the step's
  training forwards and over every rank;
- Train/MoE/<layer>/tokens/<e>: token choices routed to expert e, summed
  over the step's forwards and over every rank (before drops);
- Train/MoE/<layer>/dropped/<e>: how many of them found expert e full.

<layer> is the MoE module's qualified name. The sums travel in one
all-reduce of a (layers x (2E + 1)) fp32 tensor over every rank (collective:
every rank builds the same model, so every rank joins it). Under tensor
parallelism every model rank routes the same tokens, so the counts are the
data-parallel ones times the model-parallel size.
"""
from __future__ import annotations

import torch

from dsrun.runtime import comm
from dsrun.runtime.observability.logging import logger
from dsrun.runtime.parallel.expert.layer import MOELayer

PREFIX = "Train/MoE/"


def _layer_name(name: str) -> str:
    """The user's name of a MOELayer: that of the MoE module holding it."""
    for suffix in (".deepspeed_moe", "deepspeed_moe"):
        if name.endswith(suffix):
            return name[:-len(suffix)] or "<root>"
    return name or "<root>"


class MoEWatch:
    """The MoE layers of `module` (none: every method does nothing).

    Args:
        module: the engine's model.
        rank: this process's global rank (the warning is logged on rank 0).
    """

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        self.layers = [(_layer_name(n), m) for n, m in module.named_modules() if isinstance(m, MOELayer)]
        self.rank = rank
        self._warned: set[str] = set()

    def after_backward(self) -> None:
        """Warn once per layer whose last forward's l_aux required grad and
        got none in the backward that just ran (the loss left it out: the
        gate's load-balancing term is then not trained; DeepSpeed returns
        l_aux for the caller to add, e.g. `loss + coef * l_aux`)."""
        for name, layer in self.layers:
            if layer.load.aux_pending:
                layer.load.aux_pending = False
                if name not in self._warned:
                    self._warned.add(name)
                    if self.rank == 0:
                        logger.warning("MoE layer %s: this backward did not reach its auxiliary loss l_aux "
                                       "(the second output of the layer's forward); add it to the loss, e.g. "
                                       "loss + 0.01 * l_aux, or the gate is not load-balanced", name)

    def step_events(self, x: int, device: torch.device) -> list[tuple[str, float, int]]:
        """The step's [Note: MoE in the monitors] events (collective over
        every rank when the model has MoE layers), then a fresh count."""
        if not self.layers:
            return []
        rows = []
        for _, layer in self.layers:
            load = layer.load
            kept = load.kept.to(device=device, dtype=torch.float32) if load.kept is not None \
                else torch.zeros(load.num_experts, device=device)
            aux = load.aux_sum.to(device) if load.aux_sum is not None else torch.zeros((), device=device)
            rows.append(torch.cat([load.tokens.to(device=device, dtype=torch.float32), kept,
                                   aux.reshape(1), torch.tensor([float(load.forwards)], device=device)]))
            load.reset()
        table = torch.stack(rows)
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.all_reduce(table)
        out = []
        for (name, layer), row in zip(self.layers, table.tolist()):
            experts = layer.load.num_experts
            tokens, kept, aux, forwards = row[:experts], row[experts:2 * experts], row[-2], row[-1]
            if forwards:
                out.append((f"{PREFIX}{name}/l_aux", aux / forwards, x))
            out += [(f"{PREFIX}{name}/tokens/{e}", tokens[e], x) for e in range(experts)]
            out += [(f"{PREFIX}{name}/dropped/{e}", tokens[e] - kept[e], x) for e in range(experts)]
        return out
