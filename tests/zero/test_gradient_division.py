"""prescale_gradients and gradient_predivide_factor at 2 real gloo ranks.

The model is a dot product, loss = sum(w * x): the gradient of w on a rank
is its input x times the loss scale, exactly (x holds multiples of 1/8, the
scale is a power of two), so the reduced gradient can be computed by hand
from the definition (see [Note: dividing around the reduction] in
dsrun/runtime/optim/precision.py): each rank's gradient divided by
`before` in fp32, cast to the communication dtype, summed (a sum of two
16-bit values rounds once), back to fp32, divided by `after`, unscaled.
The checks are bitwise: with a factor of 3 the result differs from the
plain average in the last bits, so a division in the wrong place fails.
"""
import pytest
import torch

from tests.dist_helpers import run_ranks

N = 64
WORLD = 2
SCALE = 2.0 ** 8  # fp16.initial_scale_power below
DIVISIONS = {"default": {}, "prescale": {"prescale_gradients": True},
             "predivide3": {"gradient_predivide_factor": 3.0},
             "prescale_ignores_factor": {"prescale_gradients": True, "gradient_predivide_factor": 3.0}}


class Dot(torch.nn.Module):
    """loss = sum(w * x); d loss / d w = x."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(N))

    def forward(self, x):
        return (self.w * x).sum()


def _inputs(fill: float | None = None) -> list[torch.Tensor]:
    """Each rank's input (fp32, multiples of 1/8 in [-8, 8): exact in fp16 times SCALE)."""
    if fill is not None:
        return [torch.full((N,), fill) for _ in range(WORLD)]
    g = torch.Generator().manual_seed(7)
    return [torch.randint(-64, 64, (N,), generator=g).float() / 8 for _ in range(WORLD)]


def _config(stage: int, precision: str, division: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6, **division}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _rank(cases: list[tuple[int, str, str]], xs: list[torch.Tensor], divisions: dict):
    """For each (stage, precision, division name in `divisions`): the reduced,
    unscaled gradient of w after the boundary's backward, and the number of
    skipped steps after its step."""
    import dsrun
    from dsrun.runtime import comm

    out = {}
    for stage, precision, division in cases:
        torch.manual_seed(0)
        model = Dot()
        engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=_config(stage, precision, divisions[division]))
        x = xs[comm.get_rank()].to(next(model.parameters()).dtype)
        engine.backward(engine(x))
        full_grad = getattr(engine.strategy, "full_grad", None)
        grad = full_grad(model.w) if full_grad is not None else model.w.grad.float().clone()
        engine.step()
        out[(stage, precision, division)] = (grad.clone(), engine.skipped_steps)
        engine.destroy()
    return out


def expected(xs: list[torch.Tensor], precision: str, division: dict) -> torch.Tensor:
    """The definition: divide by `before`, sum in the communication dtype, divide by `after`."""
    prescale = division.get("prescale_gradients", False)
    factor = division.get("gradient_predivide_factor", 1.0)
    before, after = (float(WORLD), 1.0) if prescale else (factor, WORLD / factor)
    scale = SCALE if precision == "fp16" else 1.0
    sent = [(x * scale / before) for x in xs]
    if precision == "fp16":
        total = sum(s.half().float() for s in sent).half().float()
    else:
        total = sent[0] + sent[1]
    return total / after / scale


CASES = [(stage, prec, div) for stage in (0, 2) for prec in ("fp32", "fp16") for div in DIVISIONS]


@pytest.fixture(scope="module")
def reduced():
    return run_ranks(_rank, WORLD, CASES, _inputs(), DIVISIONS, timeout=180)


@pytest.mark.parametrize("stage, precision, division", CASES)
def test_reduced_gradient_is_the_formula(reduced, stage, precision, division):
    xs = _inputs()
    want = expected(xs, precision, DIVISIONS[division])
    for rank_result in reduced:
        grad, skipped = rank_result[(stage, precision, division)]
        assert skipped == 0
        assert torch.equal(grad.reshape(-1), want), (grad.reshape(-1) - want).abs().max()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_factor_of_three_is_not_the_plain_average(precision):
    """The formula with a factor of 3 differs from the plain average in the
    last bits: the bitwise checks above can tell where the division happened."""
    xs = _inputs()
    assert not torch.equal(expected(xs, precision, DIVISIONS["predivide3"]),
                           expected(xs, precision, DIVISIONS["default"]))


def test_fp16_sum_overflows_unless_divided_first():
    """Scaled gradients of 51200 on each rank: their sum (102400) overflows
    fp16, so the plain average skips the step (as in DeepSpeed); divided by
    2 first (prescale, or a factor of 2) the sum is 51200 and the step is
    applied with the exact average."""
    cases = [(stage, "fp16", div) for stage in (0, 2) for div in ("default", "prescale", "predivide2")]
    divisions = {**DIVISIONS, "predivide2": {"gradient_predivide_factor": 2.0}}
    results = run_ranks(_rank, WORLD, cases, _inputs(fill=200.0), divisions, timeout=180)
    for rank_result in results:
        for stage in (0, 2):
            assert rank_result[(stage, "fp16", "default")][1] == 1, "the overflow must skip the step"
            for div in ("prescale", "predivide2"):
                grad, skipped = rank_result[(stage, "fp16", div)]
                assert skipped == 0 and torch.equal(grad.reshape(-1), torch.full((N,), 200.0))
