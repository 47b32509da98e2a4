"""1-bit Adam, 0/1 Adam and 1-bit LAMB in the engine, on real gloo ranks.

References are written here plainly: Adam without bias correction (what
DeepSpeed's 1-bit Adam runs during warm-up) and the compressed all-reduce
of test_compressed_allreduce.reference_round.
"""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.comm.compressed import compressed_bus_bytes
from tests.compression.test_compressed_allreduce import reference_round
from tests.dist_helpers import run_ranks

FEATURES, HIDDEN, OUT, BATCH = 8, 24, 4, 8


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, torch.tanh(x[:, :OUT] * 2 - x[:, OUT:2 * OUT])  # learnable target


class PlainAdam(torch.optim.Optimizer):
    """Adam without bias correction, decoupled weight decay: DeepSpeed's 1-bit Adam warm-up."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v, g = st["m"], st["v"], p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])


ADAM = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _config(opt: dict | None, precision: str = "fp32", stage: int = 0) -> dict:
    cfg = {"train_batch_size": 2 * BATCH, "train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10 ** 6,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    if opt is not None:
        cfg["optimizer"] = opt
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}  # no overflow-skipped steps
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, steps: int, start: int = 0) -> list[float]:
    rank = engine.global_rank
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        x = x.to(next(engine.module.parameters()).dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _rank_warmup_equals_adam(steps: int):
    import dsrun
    onebit = {"type": "OneBitAdam", "params": {**ADAM, "betas": list(ADAM["betas"]), "freeze_step": steps}}
    engine, *_ = dsrun.initialize(model=_model(), config=_config(onebit))
    dsrun.comm.comms_logger.reset()
    _train(engine, steps)
    ops = sorted(dsrun.comm.comms_logger.snapshot())
    got = [p.detach().clone() for p in engine.module.parameters()]
    model = _model()
    ref, *_ = dsrun.initialize(model=model, config=_config(None),
                               optimizer=PlainAdam(model.parameters(), **ADAM))
    _train(ref, steps)
    return got, [p.detach().clone() for p in ref.module.parameters()], ops


def test_onebit_adam_warmup_equals_adam_exactly():
    for got, want, ops in run_ranks(_rank_warmup_equals_adam, 2, 4, timeout=120):
        for a, b in zip(got, want):
            assert torch.equal(a, b), (a - b).abs().max()
        assert "all_to_all_single" not in ops  # nothing compressed during warm-up


def _rank_after_freeze(world_grads, freeze: int):
    """OnebitAdam outside an engine: warm-up on averaged gradients, then local ones."""
    import dsrun
    from dsrun.runtime.fp16.onebit import OnebitAdam
    dsrun.init_distributed()
    rank = dsrun.comm.get_rank()
    p = torch.nn.Parameter(torch.linspace(-1, 1, world_grads[0][0].numel()))
    opt = OnebitAdam([p], freeze_step=freeze, **ADAM)
    for step_grads in world_grads:
        assert opt.gradients_averaged() == (opt.steps_done() < freeze)
        p.grad = (sum(step_grads) / len(step_grads)) if opt.gradients_averaged() else step_grads[rank].clone()
        opt.step()
    return p.detach().clone()


def test_onebit_adam_after_freeze_follows_the_paper_in_one_process():
    n, steps, freeze = 203, 6, 2
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(n, generator=gen) for _ in range(2)] for _ in range(steps)]
    for t in range(freeze):  # three elements whose gradient is zero through warm-up
        grads[t][0][:3] = grads[t][1][:3] = 0
    got = run_ranks(_rank_after_freeze, 2, grads, freeze, timeout=120)
    assert torch.equal(got[0], got[1])
    # the same in one process: Adam on the mean during warm-up, then local momenta
    # averaged by the compressed all-reduce's reference, masked where v == 0.
    p = torch.linspace(-1, 1, n)
    b1, b2 = ADAM["betas"]
    m, v = torch.zeros(n), torch.zeros(n)
    we, se = [torch.zeros(n), torch.zeros(n)], [torch.zeros(104), torch.zeros(104)]
    for t, gs in enumerate(grads, start=1):
        if t <= freeze:
            g = (gs[0] + gs[1]) / 2
            m = m * b1 + (1 - b1) * g
            v = v * b2 + (1 - b2) * g * g
        else:
            m = reference_round([m * b1 + (1 - b1) * gs[i] for i in range(2)], we, se) * (v != 0)
        p = p - ADAM["lr"] * (m / (v.sqrt() + ADAM["eps"]) + ADAM["weight_decay"] * p)
    torch.testing.assert_close(got[0], p, rtol=1e-5, atol=1e-6)
    # masked: their momentum stays 0 although later local gradients are not, so only weight decay moves them
    decay = (1 - ADAM["lr"] * ADAM["weight_decay"]) ** steps
    torch.testing.assert_close(got[0][:3], torch.linspace(-1, 1, n)[:3] * decay)


def _rank_bytes_after_freeze(precisions, steps: int):
    import dsrun
    out = {}
    for precision in precisions:
        torch.manual_seed(0)
        wide = torch.nn.Sequential(torch.nn.Linear(FEATURES, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, OUT))
        onebit = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}
        engine, *_ = dsrun.initialize(model=wide, config=_config(onebit, precision))
        _train(engine, 2)
        log = dsrun.comm.comms_logger
        log.reset()
        _train(engine, steps, start=2)
        numel = sum(p.numel() for p in engine.module.parameters())
        out[precision] = {op: (s.calls, s.bus_bytes) for op, s in log.snapshot().items()}, numel
    return out


def test_bytes_after_warmup_sixteen_times_fewer_than_fp16_all_reduce():
    steps = 3
    for precision, (stats, numel) in run_ranks(_rank_bytes_after_freeze, 2, ["fp32", "bf16", "fp16"], steps,
                                               timeout=180)[0].items():
        fp16_all_reduce = 2 * numel * 2 * (2 - 1) / 2 * steps  # bytes an fp16 gradient all-reduce sends
        # no gradient all-reduce: only the 1-element norm (4 bytes x 2(p-1)/p) per step
        assert stats["all_reduce"] == (steps, 4 * steps), precision
        assert stats["all_to_all_single"][0] == steps, precision  # one span: one compressed tensor per step
        compressed = stats["all_to_all_single"][1] + stats["all_gather_into_tensor"][1]
        padded = -(-numel // 64) * 64 + 64  # the flat span may hold alignment padding
        assert compressed <= compressed_bus_bytes(padded, 2) * steps
        # the sign bits are 1/16 of the fp16 bytes; 4-byte scales (2 per phase) and the norm come on top
        assert (compressed - 16 * steps) <= fp16_all_reduce / 16 * padded / numel
        assert fp16_all_reduce / (compressed + stats["all_reduce"][1]) > 15.9, precision


def _rank_losses(cases):
    import dsrun
    out = {}
    for name, opt, precision in cases:
        engine, *_ = dsrun.initialize(model=_model(), config=_config(opt, precision))
        losses = _train(engine, 40)
        out[(name, precision)] = (sum(losses[:5]) / 5, sum(losses[-5:]) / 5, type(engine.optimizer).__name__)
    return out


OPTIMIZERS = {
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 10}},
    "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 10, "var_update_scaler": 2,
                                                      "local_step_scaler": 8, "local_step_clipper": 4}},
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 0.02, "freeze_step": 10}},
    "Lamb": {"type": "Lamb", "params": {"lr": 0.1}},  # a step moves each layer by lr of its norm
}


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                       pytest.param("fp16", marks=pytest.mark.slow)])
def test_tiny_model_trains_with_each_optimizer(precision):
    cases = [(name, opt, precision) for name, opt in OPTIMIZERS.items()]
    results = run_ranks(_rank_losses, 2, cases, timeout=240)
    for key, (first, last, cls) in results[0].items():
        assert last < 0.7 * first, (key, first, last)
    assert {v[2] for v in results[0].values()} >= {"OnebitAdam", "ZeroOneAdam", "OnebitLamb"}


def test_zero_stages_are_refused_with_a_clear_error():
    import dsrun
    from dsrun.runtime.config import ConfigError
    for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb"):
        with pytest.raises(ConfigError, match="stage=2.*stage 0"):
            dsrun.initialize(model=_model(), config=_config(OPTIMIZERS[name], stage=2))


def test_unknown_comm_backend_is_an_error():
    from dsrun.runtime.fp16.onebit.adam import OnebitAdam
    with pytest.raises(ValueError, match="comm_backend_name='tcp'"):
        OnebitAdam([torch.nn.Parameter(torch.ones(2))], comm_backend_name="tcp")
