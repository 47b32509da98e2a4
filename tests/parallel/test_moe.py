"""Mixture of Experts (dsrun/runtime/parallel/expert/): gating against direct
implementations of its formulas, the expert groups' layout, and expert
parallelism against the same experts all on one rank (gloo)."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from dsrun.runtime.parallel.expert.gating import TopKGate, capacity, top1_gating, top2_gating, topk_gating
from tests.dist_helpers import run_ranks

HIDDEN, EXPERTS = 8, 4


# ---- gating against a direct implementation ---------------------------------------------

def _reference(logits: torch.Tensor, k: int, cf: float, min_cap: int, drop: bool):
    """Token by token: (slots {(s, e): (slot, weight)}, capacity, l_aux, exp_counts)."""
    S, E = logits.shape
    probs = logits.softmax(dim=1)
    choices = [list(probs[s].argsort(descending=True)[:k].tolist()) for s in range(S)]
    counts = [sum(e in c for c in choices) for e in range(E)]
    cap = max(math.ceil(S / E * cf * k), min_cap) if drop else max(counts)
    kept: dict[tuple[int, int], int] = {}
    fill = [0] * E
    if k == 1:  # the rows torch.topk picks from the 0/1 choice mask (DeepSpeed's top1gating)
        mask = F.one_hot(torch.tensor([c[0] for c in choices]), E)
        picked = torch.topk(mask, min(cap, S), dim=0).indices
        for e in range(E):
            mine = sorted(s for s in set(picked[:, e].tolist()) if choices[s][0] == e)
            kept.update({(s, e): slot for slot, s in enumerate(mine)})
    elif k == 2:  # first choices in token order, then second choices (GShard)
        for rank in range(k):
            for s in range(S):
                e = choices[s][rank]
                if fill[e] < cap:
                    kept[(s, e)] = fill[e]
                fill[e] += 1
    else:  # the most probable tokens of each expert, slots in token order
        for e in range(E):
            mine = sorted((s for s in range(S) if e in choices[s]), key=lambda s: -float(probs[s, e]))[:cap]
            for slot, s in enumerate(sorted(mine)):
                kept[(s, e)] = slot
    slots = {}
    for (s, e), slot in kept.items():
        total = sum(float(probs[s, f]) for f in choices[s] if (s, f) in kept)
        slots[(s, e)] = (slot, float(probs[s, e]) / (total if k > 1 else 1.0))
    first = [sum(c[0] == e for c in choices) / S for e in range(E)] if k <= 2 else [n / S for n in counts]
    l_aux = E * sum(float(probs[:, e].mean()) * first[e] for e in range(E)) / (k if k > 2 else 1)
    return slots, cap, l_aux, counts


def _check_gate(out, logits, k, cf, min_cap, drop=True):
    slots, cap, l_aux, counts = _reference(logits, k, cf, min_cap, drop)
    assert out.combine_weights.shape == (logits.shape[0], logits.shape[1], cap)
    got = {(s, e): (c, float(out.combine_weights[s, e, c])) for s, e, c in out.dispatch_mask.nonzero().tolist()}
    assert got.keys() == slots.keys()
    for key, (slot, weight) in slots.items():
        assert got[key][0] == slot and got[key][1] == pytest.approx(weight, rel=1e-5)
    assert float(out.l_aux) == pytest.approx(l_aux, rel=1e-5)
    assert out.exp_counts.tolist() == counts
    return len(slots)


@pytest.mark.parametrize("k,cf,min_cap", [(1, 1.0, 2), (1, 0.5, 1), (2, 1.0, 2), (2, 0.5, 1), (3, 0.5, 1)])
def test_gating_matches_reference(k, cf, min_cap):
    torch.manual_seed(k)
    logits = torch.randn(24, EXPERTS) + torch.tensor([1.5, 0.0, 0.0, -1.0])  # skewed: expert 0 overflows
    if k == 1:
        out = top1_gating(logits, cf, min_cap, use_rts=False)
    elif k == 2:
        out = top2_gating(logits, cf, min_cap, second_expert_sampling=False)
    else:
        out = topk_gating(logits, k, cf, min_cap)
    routed = _check_gate(out, logits, k, cf, min_cap)
    assert routed < 24 * k  # some tokens were dropped


def test_top1_without_rts_keeps_the_tokens_torch_topk_of_the_mask_keeps():
    """An over-capacity expert keeps the token indices torch.topk of the 0/1
    mask returns (DeepSpeed's top1gating), which here are not the first
    tokens in order, so the test tells the two policies apart."""
    logits = torch.tensor([[2.0, 0.0]] * 20 + [[0.0, 2.0]] * 4)
    out = top1_gating(logits, 0.5, 1, use_rts=False)  # capacity ceil(24 / 2 x 0.5) = 6 of 20
    mask = F.one_hot(logits.argmax(dim=1), 2)
    expected = sorted(torch.topk(mask, 6, dim=0).indices[:, 0].tolist())
    assert expected != list(range(6))  # torch.topk's tie order is not token order here
    kept = out.dispatch_mask[:, 0].nonzero().tolist()
    assert [s for s, _ in kept] == expected
    assert [c for _, c in kept] == list(range(6))  # slots in token order
    assert out.dispatch_mask[20:, 1].any(dim=1).all()  # expert 1 is under capacity: all 4 kept


def test_topk_probs_policy_keeps_torch_topk_of_the_gates_on_ties():
    """drop_policy "probs" with every token's gates equal: the kept tokens
    are torch.topk(sorted=False)'s of the masked gates, as DeepSpeed's."""
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]] * 16)
    out = topk_gating(logits, 3, 0.25, 1)  # capacity ceil(16 / 4 x 0.25 x 3) = 3 of 16
    gates = logits.softmax(dim=1)
    mask = torch.zeros(16, 4).scatter_(1, gates.topk(3, dim=1).indices, 1)
    picked = torch.topk(gates * mask, 3, dim=0, sorted=False).indices
    for e in range(3):
        assert out.dispatch_mask[:, e].any(dim=1).nonzero()[:, 0].tolist() == sorted(picked[:, e].tolist())


def test_capacity_and_min_capacity():
    assert capacity(24, 4, 1.0, 4) == 6 and capacity(24, 4, 0.5, 4) == 4 and capacity(25, 4, 1.0, 1) == 7
    out = top1_gating(torch.zeros(8, 4), 1.0, min_capacity=5, use_rts=False)
    assert out.combine_weights.shape[-1] == 5


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_keeps_every_token(k):
    torch.manual_seed(0)
    logits = torch.randn(20, EXPERTS) + torch.tensor([3.0, 0.0, 0.0, 0.0])
    out = {1: lambda: top1_gating(logits, 1.0, 4, drop_tokens=False),
           2: lambda: top2_gating(logits, 1.0, 4, drop_tokens=False, second_expert_sampling=False),
           3: lambda: topk_gating(logits, 3, 1.0, 4, drop_tokens=False)}[k]()
    assert int(out.dispatch_mask.sum()) == 20 * k
    assert out.combine_weights.shape[-1] == int(out.exp_counts.max())


def test_random_token_selection_keeps_a_random_subset_in_token_order():
    logits = torch.tensor([[2.0, 0.0]] * 10 + [[0.0, 2.0]] * 2)
    torch.manual_seed(0)
    out = top1_gating(logits, 1.0, 1, use_rts=True)
    kept = out.dispatch_mask[:, 0].nonzero().tolist()
    assert len(kept) == 6 and [c for _, c in kept] == list(range(6))  # capacity 6 of 10
    torch.manual_seed(0)
    again = top1_gating(logits, 1.0, 1, use_rts=True)
    assert torch.equal(out.dispatch_mask, again.dispatch_mask)  # the same seed keeps the same tokens
    draws = {tuple(top1_gating(logits, 1.0, 1, use_rts=True).dispatch_mask[:10, 0].nonzero()[:, 0].tolist())
             for _ in range(8)}
    assert len(draws) > 1  # not the first-come policy


def test_noisy_gate_policies():
    torch.manual_seed(0)
    tokens = torch.randn(16, HIDDEN)
    gate = TopKGate(HIDDEN, EXPERTS, k=1, min_capacity=1, noisy_gate_policy="RSample", use_rts=False,
                    eval_capacity_factor=EXPERTS)  # eval: room for every token
    logits = tokens @ gate.wg.weight.t()
    torch.manual_seed(1)
    out = gate(tokens)
    torch.manual_seed(1)
    u = torch.rand(logits.shape).clamp_(min=1e-20, max=1.0 - 1e-7)
    choice = (logits - torch.log(-torch.log(u))).argmax(dim=1)
    routed = out.dispatch_mask.any(dim=2)
    assert all(routed[s].nonzero()[0, 0] == choice[s] for s in range(16) if routed[s].any())
    gate.eval()  # no noise in eval
    assert torch.equal(gate(tokens).dispatch_mask.any(dim=2).float().argmax(dim=1),
                       logits.softmax(dim=1).argmax(dim=1))
    jitter = TopKGate(HIDDEN, EXPERTS, k=2, min_capacity=1, noisy_gate_policy="Jitter",
                      top2_2nd_expert_sampling=False)
    a, b = jitter(tokens).combine_weights, jitter(tokens).combine_weights
    assert not torch.equal(a, b)  # training: the router input is jittered
    jitter.eval()
    assert torch.equal(jitter(tokens).combine_weights, jitter(tokens).combine_weights)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(HIDDEN, EXPERTS, noisy_gate_policy="Gumbel")


def test_residual_mix_and_outputs():
    from dsrun.moe.layer import MoE
    torch.manual_seed(0)
    layer = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, k=1, use_residual=True,
                min_capacity=1, use_rts=False)
    x = torch.randn(2, 6, HIDDEN)
    out, l_aux, counts = layer(x)
    moe = layer.deepspeed_moe(x)
    mix = F.softmax(layer.coefficient(x), dim=-1)
    assert torch.allclose(out, moe * mix[..., :1] + layer.mlp(x) * mix[..., 1:], atol=1e-6)
    assert l_aux.dim() == 0 and counts.sum() == 12
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in layer.deepspeed_moe.experts.parameters())
    assert not hasattr(layer.mlp.weight, "allreduce")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the router stays fp32 under autocast
        assert layer(x)[1].dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=3, ep_size=2)


# ---- expert groups ------------------------------------------------------------------------

def _layout(monkeypatch, world: int, ep: int, rank: int):
    """The expert groups rank `rank` of a `world`-rank pure data-parallel job
    gets, with process-group creation faked (no processes needed)."""
    import torch.distributed as dist

    from dsrun.runtime.parallel import mesh as mesh_module
    from dsrun.utils import groups
    monkeypatch.setattr(mesh_module.comm, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(mesh_module.comm, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: tuple(ranks))
    mesh_module.set_current(mesh_module.ParallelMesh.build(world))
    try:
        name = f"ep_size_{ep}"
        return (groups._get_expert_parallel_group_ranks(name), groups._get_expert_data_parallel_group_ranks(name),
                groups._get_expert_parallel_world_size(name), groups._get_expert_parallel_rank(name),
                groups._get_expert_data_parallel_world_size(name), groups._get_expert_data_parallel_rank(name),
                groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name))
    finally:
        mesh_module.set_current(None)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_groups_follow_deepspeeds_table(monkeypatch, ep):
    """DeepSpeed's utils/groups.py example: world 16, ep 2 -> expert-parallel
    [0,1], [2,3], ...; expert-data-parallel [0,2,...,14], [1,3,...,15]."""
    for rank in range(16):
        ep_ranks, edp_ranks, ep_size, ep_rank, edp_size, edp_rank, ep_group, edp_group = \
            _layout(monkeypatch, 16, ep, rank)
        first = rank - rank % ep
        assert ep_ranks == list(range(first, first + ep)) and ep_group == tuple(ep_ranks)
        assert edp_ranks == list(range(rank % ep, 16, ep)) and edp_group == tuple(edp_ranks)
        assert (ep_size, ep_rank, edp_size, edp_rank) == (ep, rank % ep, 16 // ep, rank // ep)


def test_ep_size_must_divide_the_data_axis(monkeypatch):
    with pytest.raises(ValueError, match="ep_size=3 must be a positive divisor of the data-parallel size 16"):
        _layout(monkeypatch, 16, 3, 0)


# ---- expert parallelism against all experts on one rank ----------------------------------

def _make_experts_distinct(layer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _copy_into(ep_layer, full_layer, ep_rank: int) -> None:
    """The ep layer's weights from the full one: its slice of the experts."""
    L = ep_layer.num_local_experts
    full = full_layer.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        for i, expert in enumerate(ep_layer.deepspeed_moe.experts.deepspeed_experts):
            for p, q in zip(expert.parameters(), full[ep_rank * L + i].parameters()):
                p.copy_(q)
        ep_layer.deepspeed_moe.gate.wg.weight.copy_(full_layer.deepspeed_moe.gate.wg.weight)
        if ep_layer.use_residual:
            for p, q in zip(list(ep_layer.mlp.parameters()) + list(ep_layer.coefficient.parameters()),
                            list(full_layer.mlp.parameters()) + list(full_layer.coefficient.parameters())):
                p.copy_(q)


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 10, HIDDEN, generator=gen)
    x[..., 0] += 2.0  # skew the routing so that experts overflow
    return x, torch.randn(2, 10, HIDDEN, generator=gen)


def _ep_case(ep: int, k: int, drop: bool, residual: bool) -> dict:
    """One MoE layer at ep against the same layer with all experts local, on
    the same tokens; gradients of the experts summed over the expert-parallel
    group's tokens."""
    import torch.distributed as dist

    from dsrun.moe.layer import MoE
    from dsrun.runtime.comm import comms_logger
    from dsrun.utils import groups
    rank = dist.get_rank()
    kwargs = dict(num_experts=EXPERTS, k=k, capacity_factor=0.75, min_capacity=1, drop_tokens=drop,
                  use_rts=False, use_residual=residual, top2_2nd_expert_sampling=False)
    torch.manual_seed(0)
    full = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), ep_size=1, **kwargs)
    _make_experts_distinct(full, 7)
    layer = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), ep_size=ep, **kwargs)
    name = f"ep_size_{ep}"
    ep_rank, ep_ranks = groups._get_expert_parallel_rank(name), groups._get_expert_parallel_group_ranks(name)
    _copy_into(layer, full, ep_rank)

    x, w = _tokens(rank)
    x.requires_grad_()  # as the output of earlier layers: the backward crosses both all-to-alls
    comms_logger.reset()
    out, l_aux, counts = layer(x)
    a2a_forward = comms_logger.snapshot()["all_to_all_single"].calls
    a2a_bytes = comms_logger.snapshot()["all_to_all_single"].bytes
    (out * w).sum().backward()
    a2a_total = comms_logger.snapshot()["all_to_all_single"].calls
    routed = layer.deepspeed_moe.gate(x.detach().reshape(-1, HIDDEN), ep_group=layer.deepspeed_moe.groups().ep_group)
    dispatched, slots = int(routed.dispatch_mask.sum()), routed.combine_weights.shape[-1]

    want_grads = [torch.zeros_like(p) for p in full.deepspeed_moe.experts.parameters()]
    for r in ep_ranks:  # the expert-parallel group's tokens, each batch gated alone
        full.zero_grad()
        xr, wr = _tokens(r)
        want, want_aux, want_counts = full(xr)
        (want * wr).sum().backward()
        for acc, p in zip(want_grads, full.deepspeed_moe.experts.parameters()):
            acc += p.grad
        if r == rank:
            mine = (want.detach(), float(want_aux.detach()), want_counts.tolist(), full.deepspeed_moe.gate.wg.weight.grad.clone())
    L = layer.num_local_experts
    per_expert = len(list(full.deepspeed_moe.experts.deepspeed_experts[0].parameters()))
    want_local = want_grads[ep_rank * L * per_expert:(ep_rank + 1) * L * per_expert]
    got_local = [p.grad for p in layer.deepspeed_moe.experts.parameters()]
    return {"out": float((out.detach() - mine[0]).abs().max()), "l_aux": (float(l_aux.detach()), mine[1]),
            "counts": (counts.tolist(), mine[2]),
            "gate_grad": float((layer.deepspeed_moe.gate.wg.weight.grad - mine[3]).abs().max()),
            "expert_grad": max(float((g - e).abs().max()) for g, e in zip(got_local, want_local)),
            "a2a": (a2a_forward, a2a_total), "a2a_bytes": (a2a_bytes, 2 * EXPERTS * slots * HIDDEN * 4), "dispatched": dispatched, "tokens": x.shape[0] * x.shape[1]}


def _check_cases(results: list[list[dict]], cases) -> None:
    for per_rank in results:
        for (ep, k, drop, residual), got in zip(cases, per_rank):
            where = f"ep={ep} k={k} drop_tokens={drop} residual={residual}"
            assert got["out"] < 1e-5 and got["gate_grad"] < 1e-5 and got["expert_grad"] < 1e-5, (where, got)
            assert got["l_aux"][0] == pytest.approx(got["l_aux"][1], rel=1e-6), where
            assert got["counts"][0] == got["counts"][1], where
            assert got["a2a"] == (2, 4), where  # one all-to-all each way, forward and backward
            assert got["a2a_bytes"][0] == got["a2a_bytes"][1], where  # E x C x M fp32 elements each way
            if drop:
                assert got["dispatched"] < got["tokens"] * k, where  # the skew makes experts overflow
            else:
                assert got["dispatched"] == got["tokens"] * k, where  # dropless: nothing dropped


CASES_2 = [(2, 1, True, False), (2, 2, True, True), (2, 1, False, False)]


def _cases(cases) -> list[dict]:
    import dsrun
    dsrun.init_distributed()
    return [_ep_case(*case) for case in cases]


def test_ep2_on_2_ranks_equals_all_experts_local():
    _check_cases(run_ranks(_cases, 2, CASES_2, timeout=120), CASES_2)


class _Net(torch.nn.Module):
    """A tiny regression model with one MoE layer; the loss adds 0.01 x l_aux."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from dsrun.moe.layer import MoE
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 16), torch.nn.ReLU(), torch.nn.Linear(16, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=1.0, min_capacity=1,
                       top2_2nd_expert_sampling=False, use_residual=True)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        h = torch.relu(self.inp(x))
        m, l_aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * l_aux


def _train(ep: int, reference: dict | None, extra: dict | None = None) -> tuple[list[float], list[float], dict]:
    """4 steps of AdamW with clipping (config plus `extra`: a ZeRO stage, a
    precision); returns (mean loss over ranks, grad norm) per step and the
    initial weights (of the ep=1 model: by global name)."""
    import torch.distributed as dist

    import dsrun
    from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from dsrun.utils import groups
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    net = _Net(ep)
    L = net.moe.num_local_experts
    if reference is None:
        _make_experts_distinct(net.moe.deepspeed_moe.experts, 7)
    else:
        first = groups._get_expert_parallel_rank(f"ep_size_{ep}") * L
        with torch.no_grad():
            for name, p in net.named_parameters():
                if ".deepspeed_experts." in name:
                    head, _, rest = name.partition(".deepspeed_experts.")
                    index, _, tail = rest.partition(".")
                    name = f"{head}.deepspeed_experts.{first + int(index)}.{tail}"
                p.copy_(reference[name])
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    params = split_params_into_different_moe_groups_for_optimizer({"params": net.parameters(), "name": "parameters"})
    engine, *_ = dsrun.initialize(model=net, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.1, "steps_per_print": 1000, **(extra or {})})
    losses, norms = [], []
    for step in range(4):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(12, HIDDEN, generator=gen), torch.randn(12, generator=gen)
        dtype = engine.module.inp.weight.dtype  # the compute dtype (bf16 models take bf16 inputs)
        loss = engine(x.to(dtype), y.to(dtype))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        norms.append(engine.get_global_grad_norm())
        assert engine.skipped_steps == 0
    engine.destroy()
    return losses, norms, initial


def _world4() -> dict:
    import dsrun
    dsrun.init_distributed()
    cases = [_ep_case(*case) for case in CASES_4]
    want_loss, want_norm, initial = _train(1, None)
    got_loss, got_norm, _ = _train(2, initial)
    return {"cases": cases, "want": (want_loss, want_norm), "got": (got_loss, got_norm)}


CASES_4 = [(2, 2, True, False), (2, 1, False, True), (4, 1, True, False)]


def test_world4_ep2_matches_all_experts_local_and_trains_alike():
    """4 ranks: ep=2 x expert-data=2 (and ep=4) layers against all experts
    local; then training (AdamW, clipping at 0.1 below the gradient norm, the
    stage-0 strategy reducing experts over their expert-data group) at ep=2
    against ep=1 on the same samples: losses and norms equal to 1e-5 relative."""
    results = run_ranks(_world4, 4, timeout=180)
    _check_cases([r["cases"] for r in results], CASES_4)
    want_loss, want_norm = results[0]["want"]
    got_loss, got_norm = results[0]["got"]
    assert want_loss[-1] < want_loss[0]  # it trains
    assert got_loss == pytest.approx(want_loss, rel=1e-5) and got_norm == pytest.approx(want_norm, rel=1e-5)
    assert all(r["got"] == results[0]["got"] for r in results)


def _ep2_training(shm_env: str) -> dict:
    os.environ["DSRUN_SHM_COMM"] = shm_env
    import dsrun
    from dsrun.runtime import comm
    dsrun.init_distributed()
    losses, norms, _ = _train(2, None)
    ops = comm.comms_logger.snapshot()
    return {"losses": losses, "norms": norms, "all_to_all": ops["all_to_all_single"].transports,
            "all_reduce": ops["all_reduce"].transports}


def test_ep2_on_4_ranks_trains_alike_over_shared_memory_and_gloo():
    """ep=2 x expert-data=2: the MoE all-to-alls and the expert-data
    all-reduces over shared memory (expert and expert-data subgroups served
    by shm) give gloo's losses and norms (sums in another order: 1e-6)."""
    shm = run_ranks(_ep2_training, 4, "1", timeout=180)
    gloo = run_ranks(_ep2_training, 4, "0", timeout=180)
    for r in range(4):
        assert set(shm[r]["all_to_all"]) == {"shm"} and set(gloo[r]["all_to_all"]) == {"torch"}
        assert set(shm[r]["all_reduce"]) == {"shm"}
        assert shm[r]["losses"] == pytest.approx(gloo[r]["losses"], rel=1e-6)
        assert shm[r]["norms"] == pytest.approx(gloo[r]["norms"], rel=1e-6)
    assert len(set(gloo[0]["losses"])) == 4 and min(gloo[0]["norms"]) > 0  # four real steps
