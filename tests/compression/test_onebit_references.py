"""0/1 Adam and 1-bit LAMB on 2 gloo ranks against their algorithms written
out plainly in one process (both ranks simulated), with the compressed
all-reduce's reference from test_compressed_allreduce."""
from __future__ import annotations

import pytest
import torch

from dsrun.runtime.comm.compressed import server_chunk_numel
from tests.compression.test_compressed_allreduce import reference_round
from tests.dist_helpers import run_ranks

N, STEPS, LR, B1, B2, EPS, WD = 67, 14, 0.01, 0.9, 0.99, 1e-8, 0.01


def _grads():
    gen = torch.Generator().manual_seed(11)
    return [[torch.randn(N, generator=gen) for _ in range(2)] for _ in range(STEPS)]


ZOADAM = dict(var_freeze_step=7, var_update_scaler=2, local_step_scaler=3, local_step_clipper=2)
LAMB = dict(freeze_step=6)


def _rank_runs(grads):
    import dsrun
    dsrun.init_distributed()
    return {"zoadam": _run("zoadam", grads, ZOADAM), "lamb": _run("lamb", grads, LAMB)}


@pytest.fixture(scope="module")
def runs():
    grads = _grads()
    return grads, run_ranks(_rank_runs, 2, grads, timeout=120)


def _run(kind: str, grads, kwargs):
    """The optimizer in a plain loop that all-reduces when the optimizer asks for it."""
    import dsrun
    from dsrun.runtime.fp16.onebit import OnebitLamb, ZeroOneAdam
    rank = dsrun.comm.get_rank()
    p = torch.nn.Parameter(torch.linspace(-1, 1, N))
    cls = {"zoadam": ZeroOneAdam, "lamb": OnebitLamb}[kind]
    opt = cls([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, **kwargs)
    averaged = []
    for gs in grads:
        averaged.append(opt.gradients_averaged())
        p.grad = (gs[0] + gs[1]) / 2 if averaged[-1] else gs[rank].clone()
        opt.step()
    return p.detach().clone(), averaged


def _chunk():
    return server_chunk_numel(N, 2)


def reference_zero_one_adam(grads, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper):
    p = [torch.linspace(-1, 1, N) for _ in range(2)]
    m = [torch.zeros(N) for _ in range(2)]
    u = [torch.zeros(N) for _ in range(2)]
    v = torch.zeros(N)
    we, se = [torch.zeros(N)] * 2, [torch.zeros(_chunk())] * 2
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    averaged = []
    for t, gs in enumerate(grads, start=1):
        frozen = t - 1 > var_freeze_step  # DeepSpeed: frozen once more than var_freeze_step steps are done
        if frozen and t - 1 == var_freeze_step + 1:
            we, se = [torch.zeros(N)] * 2, [torch.zeros(_chunk())] * 2
        var_step = not frozen and t % var_interval == 0
        averaged.append(var_step)
        if var_step:
            g = (gs[0] + gs[1]) / 2
            v = B2 * v + (1 - B2) * g * g
            gi = [g, g]
        elif not frozen:
            g = reference_round([gs[0], gs[1]], we, se) * (v != 0)
            gi = [g, g]
        else:
            gi = gs
        denom = v.sqrt() + EPS
        for i in range(2):
            m[i] = B1 * m[i] + (1 - B1) * gi[i]
            update = m[i] / denom + WD * p[i]
            p[i] = p[i] - LR * update
            if frozen:
                u[i] = u[i] - LR * update
        if frozen:
            lrs += LR
            if t % local_interval == 0:
                scaled = [u[i] * denom for i in range(2)]
                for i in range(2):
                    p[i] = p[i] - u[i]
                mean = reference_round(scaled, we, se) * (v != 0)
                for i in range(2):
                    m[i] = -mean / lrs
                    p[i] = p[i] + mean / denom
                    u[i] = torch.zeros(N)
                lrs = 0.0
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
        elif var_step:
            var_counter += 1
            if var_counter == var_update_scaler:
                var_counter, var_interval = 0, var_interval * 2
    return p, averaged


def test_zero_one_adam_matches_its_algorithm(runs):
    grads, results = runs
    got = [r["zoadam"] for r in results]
    want, averaged = reference_zero_one_adam(grads, **ZOADAM)
    assert got[0][1] == averaged and False in averaged[:8] and True in averaged[:8]  # rounds skipped
    for rank in range(2):
        torch.testing.assert_close(got[rank][0], want[rank], rtol=1e-5, atol=1e-6)


def reference_onebit_lamb(grads, freeze_step, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, threshold=0.1,
                          min_coeff=0.01, max_coeff=10.0):
    p = torch.linspace(-1, 1, N)
    m, v = torch.zeros(N), torch.zeros(N)
    fresh = torch.zeros(N)
    freeze_coeff, last_factor, scaling = 0.0, 1.0, 1.0
    we, se = [torch.zeros(N)] * 2, [torch.zeros(_chunk())] * 2
    for t, gs in enumerate(grads, start=1):
        if t <= freeze_step:
            g = (gs[0] + gs[1]) / 2
            m = B1 * m + (1 - B1) * g
            v = B2 * v + (1 - B2) * g * g
            if t == freeze_step:
                fresh = v.clone()
            update = m / (v.sqrt() + EPS) + WD * p
            ratio = min(max(float(p.norm() / update.norm()), min_coeff), max_coeff)
            if ratio != 1.0:
                freeze_coeff = coeff_beta * freeze_coeff + (1 - coeff_beta) * ratio
            p = p - LR * ratio * update
            continue
        if t == freeze_step + 1:
            scaling = 1.0  # one layer: the mean RMS over layers is its own
        m_prev = m
        m = reference_round([(B1 * m + (1 - B1) * gs[i]) * scaling for i in range(2)], we, se) * (v != 0) / scaling
        g = (m - B1 * m_prev) / (1 - B1)
        fresh = B2 * fresh + (1 - B2) * g * g
        denom = v.sqrt() + EPS
        prelim = m / denom
        update = prelim + WD * p
        factor = float((denom / (fresh.sqrt() + EPS)).max())
        mix = min(1.0, float(prelim.norm() / update.norm()))
        factor = factor * mix + (1 - mix)
        factor = min(max(factor, factor_min), factor_max)
        factor = min(max(factor, last_factor * (1 - threshold)), last_factor * (1 + threshold))
        last_factor = factor
        p = p - LR * freeze_coeff * factor * update
    return p


def test_onebit_lamb_matches_its_algorithm(runs):
    grads, results = runs
    got = [r["lamb"] for r in results]
    want = reference_onebit_lamb(grads, LAMB["freeze_step"])
    assert got[0][1] == [True] * 6 + [False] * (STEPS - 6)
    for rank in range(2):
        torch.testing.assert_close(got[rank][0], want, rtol=1e-5, atol=1e-6)
