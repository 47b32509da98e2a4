"""The engine's MoE checks and reports (dsrun/runtime/parallel/expert/watch.py):
the once-per-layer warning when the loss leaves l_aux out, the monitors'
per-layer expert load, and a rank whose tokens all go elsewhere (2 gloo ranks)."""
from __future__ import annotations

import pytest

from tests.dist_helpers import run_ranks

HIDDEN, EXPERTS = 8, 4


def _watch(out_dir: str) -> dict:
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.moe.layer import MoE
    dsrun.init_distributed()
    rank = dist.get_rank()

    class Net(torch.nn.Module):
        def __init__(self, drop: bool, use_aux: bool):
            super().__init__()
            self.use_aux = use_aux
            self.moe = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=2, k=1,
                           min_capacity=1, capacity_factor=1.0, drop_tokens=drop, use_rts=False)
            with torch.no_grad():  # every token prefers expert 0 (held by expert-parallel rank 0)
                self.moe.deepspeed_moe.gate.wg.weight.zero_()
                self.moe.deepspeed_moe.gate.wg.weight[0, 0] = 10.0

        def forward(self, x):
            out, l_aux, _ = self.moe(x)
            loss = F.mse_loss(out, x)
            return loss + 0.01 * l_aux if self.use_aux else loss

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("dsrun").addHandler(handler)
    out = {}
    for drop, use_aux in ((True, False), (False, True)):
        net = Net(drop, use_aux)
        engine, *_ = dsrun.initialize(model=net, model_parameters=list(net.parameters()), config={
            "train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
            "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": f"moe{drop}"}})
        events = []
        engine.monitor.write_events = events.extend
        for step in range(2):
            x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank)).abs()
            engine.backward(engine(x))
            engine.step()
        out[f"drop={drop}"] = {"events": {n: v for n, v, _ in events if n.startswith("Train/MoE/")},
                               "steps": engine.global_steps}
        engine.destroy()
    out["warnings"] = [w for w in warnings if "auxiliary loss" in w]
    return out


def test_warning_monitor_load_and_a_rank_with_no_tokens(tmp_path):
    """All 12 tokens of a step (6 per rank) choose expert 0, held by rank 0,
    so rank 1's experts get none: both steps complete (no hang) with and
    without drops. Capacity ceil(6 / 4) = 2 per rank keeps 2 of each rank's 6;
    the monitors see 12 tokens on expert 0 per step, 8 dropped; dropless
    drops nothing. Leaving l_aux out of the loss warns once, on rank 0,
    naming the layer."""
    results = run_ranks(_watch, 2, str(tmp_path), timeout=180)
    zero = results[0]
    dropping, dropless = zero["drop=True"]["events"], zero["drop=False"]["events"]
    assert zero["drop=True"]["steps"] == zero["drop=False"]["steps"] == 2
    assert [dropping[f"Train/MoE/moe/tokens/{e}"] for e in range(EXPERTS)] == [12.0, 0.0, 0.0, 0.0]
    assert [dropping[f"Train/MoE/moe/dropped/{e}"] for e in range(EXPERTS)] == [8.0, 0.0, 0.0, 0.0]
    assert [dropless[f"Train/MoE/moe/dropped/{e}"] for e in range(EXPERTS)] == [0.0] * EXPERTS
    # all tokens on one expert: l_aux = E x (mean gate probability of expert 0), between 1 (balanced) and E
    assert 2.0 < dropping["Train/MoE/moe/l_aux"] <= EXPERTS
    assert len(zero["warnings"]) == 1 and "MoE layer moe:" in zero["warnings"][0]
    assert results[1]["warnings"] == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_forward_once(reentrant):
    """Checkpointing's recompute (inside the backward) is not a second
    forward: tokens are counted once, and a loss with l_aux leaves nothing
    pending; without it, non-reentrant checkpointing still flags the layer
    (reentrant's first pass runs without grad: no l_aux to watch)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from dsrun.moe.layer import MoE
    torch.manual_seed(0)
    layer = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=2, min_capacity=1)
    x = torch.randn(6, HIDDEN, requires_grad=True)
    load = layer.deepspeed_moe.load
    for use_aux in (True, False):
        load.reset()
        out, l_aux = checkpoint(lambda t: layer(t)[:2], x, use_reentrant=reentrant)
        (out.sum() + l_aux if use_aux else out.sum()).backward()
        assert load.forwards == 1 and int(load.tokens.sum()) == 6
        assert load.aux_pending is (not use_aux and not reentrant)
