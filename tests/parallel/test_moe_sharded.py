"""`deepspeed.moe.sharded_moe` (dsrun/moe/sharded_moe.py): the gating
functions under DeepSpeed's signatures against a direct implementation of
their formulas (seeded noise included), and TopKGate + Experts + MOELayer
built by hand, as Megatron-DeepSpeed does, at ep_size 2 on 2 ranks against
the same experts all on one rank (gloo)."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.moe.sharded_moe import (MOELayer, TopKGate, _capacity, einsum, gumbel_rsample, multiplicative_jitter,
                                   top1gating, top2gating, topkgating)
from tests.dist_helpers import run_ranks

HIDDEN, EXPERTS, TOKENS = 8, 4, 24


def _logits(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(TOKENS, EXPERTS) + torch.tensor([1.5, 0.0, 0.0, -1.0])  # skewed: expert 0 overflows


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))


def _direct(logits, choices, cap, policy, k, score=None):
    """The gate's outputs token by token from explicit choices (choices[s]:
    token s's experts, best first; [] for a token left out).

    policy "order": first choices in token order, then second choices
    (GShard); "score": each expert keeps the `cap` tokens with the largest
    score[s, e], slots in token order (RTS: random scores; top-k: probs);
    "mask": each expert keeps the rows torch.topk of the 0/1 choice mask
    picks (top-1 without RTS), slots in token order.
    Returns (combine [S, E, cap], l_aux, exp_counts)."""
    S, E = logits.shape
    probs = logits.softmax(dim=1)
    kept: dict[tuple[int, int], int] = {}
    if policy == "mask":
        mask = torch.tensor([[int(e in c) for e in range(E)] for c in choices])
        picked = torch.topk(mask, min(cap, S), dim=0).indices
        for e in range(E):
            mine = sorted(s for s in set(picked[:, e].tolist()) if mask[s, e])
            kept.update({(s, e): slot for slot, s in enumerate(mine)})
    elif policy == "order":
        fill = [0] * E
        for rank in range(max(len(c) for c in choices)):
            for s in range(S):
                if rank < len(choices[s]):
                    e = choices[s][rank]
                    if fill[e] < cap:
                        kept[(s, e)] = fill[e]
                    fill[e] += 1
    else:
        for e in range(E):
            mine = sorted((s for s in range(S) if e in choices[s]), key=lambda s: -float(score[s, e]))[:cap]
            for slot, s in enumerate(sorted(mine)):
                kept[(s, e)] = slot
    combine = torch.zeros(S, E, cap)
    for (s, e), slot in kept.items():
        total = sum(float(probs[s, f]) for f in choices[s] if (s, f) in kept) if k > 1 else 1.0
        combine[s, e, slot] = float(probs[s, e]) / total
    counts = [sum(e in c for c in choices) for e in range(E)]
    if k <= 2:
        ce = [sum(1 for c in choices if c and c[0] == e) / S for e in range(E)]
    else:
        ce = [n / S for n in counts]
    l_aux = E * sum(float(probs[:, e].mean()) * ce[e] for e in range(E)) / (k if k > 2 else 1)
    return combine, l_aux, counts


def _assert_matches(out, want):
    l_aux, combine, dispatch, counts = out  # DeepSpeed's 4-tuple unpacks
    want_combine, want_l_aux, want_counts = want
    assert combine.shape == want_combine.shape
    assert torch.allclose(combine, want_combine, atol=1e-6)
    assert torch.equal(dispatch, want_combine != 0) and dispatch.dtype == torch.bool
    assert float(l_aux.detach()) == pytest.approx(want_l_aux, rel=1e-5)
    assert counts.tolist() == want_counts and counts.dtype == torch.int64


def _ranked(logits: torch.Tensor, k: int) -> list[list[int]]:
    return [logits[s].softmax(dim=0).argsort(descending=True)[:k].tolist() for s in range(logits.shape[0])]


@pytest.mark.parametrize("cf,min_cap", [(1.0, 2), (0.5, 1), (1.0, 8)])
def test_top1gating_without_rts_keeps_torch_topk_of_the_mask(cf, min_cap):
    logits = _logits(1)
    cap = max(math.ceil(TOKENS / EXPERTS * cf), min_cap)
    out = top1gating(logits, cf, min_cap, None, None, True, False)  # DeepSpeed's positional order
    _assert_matches(out, _direct(logits, _ranked(logits, 1), cap, "mask", 1))
    assert int(out[2].sum()) < TOKENS or min_cap == 8  # the skew drops tokens unless the capacity is large


def test_top1gating_random_token_selection_and_rsample_with_a_seed():
    logits, cap = _logits(2), 3
    torch.manual_seed(5)
    out = top1gating(logits, 0.5, cap, use_rts=True)
    torch.manual_seed(5)
    score = torch.rand(TOKENS, EXPERTS)  # RTS: a uniform score per (token, expert)
    _assert_matches(out, _direct(logits, _ranked(logits, 1), cap, "score", 1, score))

    torch.manual_seed(6)
    out = top1gating(logits, 1.0, 1, noisy_gate_policy="RSample", use_rts=False)
    torch.manual_seed(6)
    noisy = logits + _gumbel(torch.rand(TOKENS, EXPERTS))  # the choice on Gumbel-noised logits
    choices = [[int(noisy[s].argmax())] for s in range(TOKENS)]
    _assert_matches(out, _direct(logits, choices, math.ceil(TOKENS / EXPERTS), "mask", 1))
    assert choices != _ranked(logits, 1)  # the noise changed some choices


def test_top1gating_used_token_leaves_tokens_out():
    logits = _logits(3)
    used = (torch.arange(TOKENS) % 3 != 0).float()
    out = top1gating(logits, 1.0, 1, used, use_rts=False)
    choices = [c if used[s] else [] for s, c in enumerate(_ranked(logits, 1))]
    _assert_matches(out, _direct(logits, choices, math.ceil(TOKENS / EXPERTS), "mask", 1))
    assert int(out[3].sum()) == int(used.sum())


@pytest.mark.parametrize("cf", [1.0, 0.5])
def test_top2gating(cf):
    logits = _logits(4)
    cap = max(math.ceil(TOKENS / EXPERTS * cf * 2), 1)
    out = top2gating(logits, cf, 1, True, None, False)
    _assert_matches(out, _direct(logits, _ranked(logits, 2), cap, "order", 2))

    torch.manual_seed(7)  # second choice on Gumbel-noised logits (top2_2nd_expert_sampling)
    before = logits.clone()
    out = top2gating(logits, cf, 1)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    torch.manual_seed(7)
    noisy = logits + _gumbel(torch.rand(TOKENS, EXPERTS))
    first = logits.argmax(dim=1)
    choices = [[int(first[s]), int(noisy[s].masked_fill(torch.arange(EXPERTS) == first[s], float("-inf")).argmax())]
               for s in range(TOKENS)]
    _assert_matches(out, _direct(logits, choices, cap, "order", 2))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_topkgating_drop_policies(policy):
    logits, k = _logits(5), 3
    cap = max(math.ceil(TOKENS / EXPERTS * 0.5 * k), 1)
    out = topkgating(logits, k, 0.5, 1, True, None, policy)
    want = (_direct(logits, _ranked(logits, k), cap, "score", k, logits.softmax(dim=1)) if policy == "probs"
            else _direct(logits, _ranked(logits, k), cap, "score", k, -torch.arange(TOKENS).float().unsqueeze(1)
                         .expand(TOKENS, EXPERTS)))  # "position": the first tokens in token order
    _assert_matches(out, want)
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(logits, k, 0.5, 1, drop_policy="random")


def test_dropless_and_helpers():
    logits = _logits(6)
    for out, k in ((top1gating(logits, 1.0, 4, drop_tokens=False, use_rts=False), 1),
                   (top2gating(logits, 1.0, 4, drop_tokens=False, top2_2nd_expert_sampling=False), 2),
                   (topkgating(logits, 3, 1.0, 4, drop_tokens=False), 3)):
        assert int(out[2].sum()) == TOKENS * k and out[1].shape[-1] == int(out[3].max())
    cap = _capacity(logits.softmax(dim=1), torch.tensor(0.5), torch.tensor(4))
    assert cap.dtype == torch.int64 and cap.dim() == 0 and int(cap) == 4
    assert int(_capacity(logits, 1.3, 1)) == math.ceil(TOKENS / EXPERTS * 1.3)
    x = torch.randn(64, HIDDEN)
    torch.manual_seed(0)
    jittered = multiplicative_jitter(x, x.device, epsilon=0.1)
    ratio = jittered / x
    assert ratio.min() >= 0.9 - 1e-6 and ratio.max() <= 1.1 + 1e-6 and ratio.std() > 0.01
    torch.manual_seed(0)
    assert torch.equal(multiplicative_jitter(x, x.device, epsilon=0.1), jittered)  # seeded
    assert multiplicative_jitter(x, x.device, epsilon=0) is x
    torch.manual_seed(0)
    g = gumbel_rsample((200_000,), torch.device("cpu"))
    assert float(g.mean()) == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni: a standard Gumbel's mean
    assert float(g.var()) == pytest.approx(math.pi ** 2 / 6, rel=0.02)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.allclose(einsum("se,ec->sc", a, b), a @ b)


def test_topkgate_takes_deepspeeds_arguments():
    torch.manual_seed(0)
    gate = TopKGate(HIDDEN, EXPERTS, 2, 1.0, 2.0, 1, None, True, False, None, False)  # DeepSpeed's positions
    assert gate.ep_group is None and TopKGate(HIDDEN, EXPERTS).min_capacity == 8  # DeepSpeed's default
    x = torch.randn(TOKENS, HIDDEN)
    l_aux, combine, dispatch, counts = gate(x)
    logits = (x @ gate.wg.weight.t()).detach()
    _assert_matches((l_aux, combine, dispatch, counts),
                    _direct(logits, _ranked(logits, 2), math.ceil(TOKENS / EXPERTS * 2), "order", 2))
    gate.eval()  # eval_capacity_factor 2.0
    assert gate(x)[1].shape[-1] == math.ceil(TOKENS / EXPERTS * 2.0 * 2)
    gate._set_ep_group("group")
    with pytest.raises(ValueError, match="set already"):
        gate._set_ep_group("group")


def test_moelayer_checks_its_arguments():
    from dsrun.moe.experts import Experts
    from dsrun.moe.layer import MoE
    layer = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS)  # the same classes MoE builds
    assert isinstance(layer.deepspeed_moe, MOELayer) and isinstance(layer.deepspeed_moe.gate, TopKGate)
    assert layer.deepspeed_moe.ep_group_name == "ep_size_1" and layer.deepspeed_moe.gate.min_capacity == 4
    gate = TopKGate(HIDDEN, EXPERTS, min_capacity=1)
    with pytest.raises(ValueError, match="ep_group_name='experts' must be 'ep_size_1'"):
        MOELayer(gate, Experts(torch.nn.Linear(HIDDEN, HIDDEN), EXPERTS), "experts", 1, EXPERTS)
    with pytest.raises(ValueError, match="num_local_experts=2 must equal the gate's num_experts=4"):
        MOELayer(gate, Experts(torch.nn.Linear(HIDDEN, HIDDEN), 2), "ep_size_1", 1, 2)


# ---- hand-built MOELayer at ep_size 2 against all experts on one rank ---------------------

def _hand_built(ep: int, k: int, drop: bool, seed: int) -> MOELayer:
    """As Megatron-DeepSpeed builds one: TopKGate, Experts, MOELayer, then the
    expert-parallel group handed over with _set_ep_group."""
    from dsrun.moe.experts import Experts
    from dsrun.utils import groups
    torch.manual_seed(seed)
    name = f"ep_size_{ep}"
    gate = TopKGate(HIDDEN, EXPERTS, k, 0.75, 0.75, 1, None, drop, False, None, False)
    experts = Experts(torch.nn.Linear(HIDDEN, HIDDEN), EXPERTS // ep, name)
    layer = MOELayer(gate, experts, name, ep, EXPERTS // ep, use_tutel=False)
    groups._create_expert_and_data_parallel(ep)
    layer._set_ep_group(groups._get_expert_parallel_group(name))
    return layer


def _distinct_experts(layer, ep_rank: int, ep: int) -> None:
    """Expert e (global id) gets weights seeded by e."""
    L = EXPERTS // ep
    with torch.no_grad():
        for i, expert in enumerate(layer.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(50 + ep_rank * L + i)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _tokens(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 10, HIDDEN, generator=gen)
    x[..., 0] += 2.0
    return x


def _sharded_case(k: int, drop: bool) -> dict:
    import torch.distributed as dist
    rank = dist.get_rank()
    layer = _hand_built(2, k, drop, seed=3)
    full = _hand_built(1, k, drop, seed=3)  # the same gate weights (same seed), all experts local
    _distinct_experts(layer, rank, 2)
    _distinct_experts(full, 0, 1)
    x = _tokens(rank)
    out = layer(x, None)
    out.sum().backward()
    grads = [torch.zeros_like(p) for p in full.experts.parameters()]
    for r in range(2):  # the experts see both ranks' tokens
        full.zero_grad()
        want = full(_tokens(r))
        want.sum().backward()
        for acc, p in zip(grads, full.experts.parameters()):
            acc += p.grad
        if r == rank:
            mine = (want.detach(), float(full.l_aux), full.exp_counts.tolist())
    per_expert = len(list(full.experts.deepspeed_experts[0].parameters()))
    L = EXPERTS // 2
    want_local = grads[rank * L * per_expert:(rank + 1) * L * per_expert]
    try:  # the ep_size 1 layer's group is this rank alone: the world group is refused
        full._set_ep_group(dist.group.WORLD)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"out": float((out.detach() - mine[0]).abs().max()), "l_aux": (float(layer.l_aux), mine[1]),
            "counts": (layer.exp_counts.tolist(), mine[2]), "dispatched": int(layer.exp_counts.sum()),
            "grad": max(float((p.grad - g).abs().max()) for p, g in zip(layer.experts.parameters(), want_local)),
            "refused": refused}


def _sharded_cases(cases) -> list[dict]:
    import dsrun
    dsrun.init_distributed()
    return [_sharded_case(*case) for case in cases]


SHARDED_CASES = [(1, True), (2, False)]


def test_hand_built_moelayer_ep2_on_2_ranks_equals_all_experts_local():
    """Outputs, l_aux, exp_counts and expert gradients of the hand-built ep=2
    layer equal those of the same experts on one rank, to 1e-5."""
    results = run_ranks(_sharded_cases, 2, SHARDED_CASES, timeout=120)
    for per_rank in results:
        for (k, drop), got in zip(SHARDED_CASES, per_rank):
            where = f"k={k} drop_tokens={drop}"
            assert got["out"] < 1e-5 and got["grad"] < 1e-5, (where, got)
            assert got["l_aux"][0] == pytest.approx(got["l_aux"][1], rel=1e-6), where
            assert got["counts"][0] == got["counts"][1], where
            assert got["refused"] is not None and "holds ranks [0, 1]" in got["refused"], where
