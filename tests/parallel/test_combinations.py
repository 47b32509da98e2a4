"""The combination table (dsrun/runtime/parallel/combinations.py): every pair
has one entry, each refused pair raises one ConfigError naming both settings
before any collective of training, and each "works" pair names a test that
exists."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrun.runtime.config import ConfigError
from dsrun.runtime.parallel import combinations as combos
from tests.dist_helpers import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def test_every_pair_of_settings_has_exactly_one_entry():
    pairs = {frozenset(p) for p in itertools.combinations(combos.SETTINGS, 2)}
    exclusive = {p for p in pairs if any(p <= group for group in combos.EXCLUSIVE)}
    assert set(combos.TABLE) == pairs - exclusive
    assert all(isinstance(e, (combos.Works, combos.Refused)) for e in combos.TABLE.values())
    for pair, test in combos._TESTED.items():  # a test cannot train a refused pair
        assert isinstance(combos.TABLE[pair], combos.Works) and combos.TABLE[pair].test == test, sorted(pair)


@pytest.mark.parametrize("pair", sorted(sorted(p) for p, e in combos.TABLE.items() if isinstance(e, combos.Refused)),
                         ids="-x-".join)
def test_each_refused_pair_raises_naming_both_settings_and_the_fix(pair):
    entry = combos.TABLE[frozenset(pair)]
    with pytest.raises(ConfigError) as info:
        combos.check_combinations(pair + ["gradient_accumulation"])
    assert info.value.problems == [info.value.args[0]]  # one problem: the pair, nothing else
    text = str(info.value)
    assert all(combos.SETTINGS[name] in text for name in pair)
    assert entry.fix in text and entry.reason in text


def test_works_pairs_pass_and_every_refused_pair_of_a_job_is_listed_at_once():
    for pair, entry in combos.TABLE.items():
        if isinstance(entry, combos.Works):
            combos.check_combinations(pair)
    with pytest.raises(ConfigError) as info:
        combos.check_combinations(["onebit", "zero:2", "expert", "mics", "bf16"])
    assert len(info.value.problems) == 4  # onebit x zero:2, x expert, x mics; expert x mics
    with pytest.raises(KeyError, match="unknown settings"):
        combos.check_combinations(["zero:4"])


def test_every_named_test_exists():
    """Each "works" pair's test id is collected by pytest (a renamed test
    or parameter fails here)."""
    ids = sorted({e.test for e in combos.TABLE.values() if isinstance(e, combos.Works) and e.test})
    files = sorted({i.split("::")[0] for i in ids})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = set(out.stdout.split())
    missing = [i for i in ids if i not in collected]
    assert not missing, (missing, out.stdout[-2000:], out.stderr[-2000:])


def test_settings_of_reads_config_model_and_degrees():
    from dsrun.runtime.config import load_config
    from tests.parallel.test_moe import _Net
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                       "bf16": {"enabled": True}, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2,
                                             "offload_param": {"device": "cpu"}}}, world_size=2)
    assert combos.settings_of(cfg, _Net(1), 1, 2, 1) == {
        "zero:3", "tensor", "expert", "bf16", "onebit", "mics", "hpz", "offload_param:cpu", "gradient_accumulation"}
    plain = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"mics_shard_size": 2}},
                        world_size=1)
    assert combos.settings_of(plain, torch.nn.Linear(2, 2), 1, 1, 4) == {"zero:0", "sequence"}  # MiCS: no-op at 0
    from dsrun.runtime.fp16.onebit.adam import OnebitAdam
    model = torch.nn.Linear(2, 2)
    client = OnebitAdam(model.parameters(), lr=1e-3)  # a script's own 1-bit optimizer counts too
    assert combos.settings_of(plain, model, 2, 1, 1, client) == {"zero:0", "pipeline:1f1b", "onebit"}


def _initialize_refused() -> str:
    """initialize of a 2-stage pipeline with a 1-bit optimizer (a refused
    pair): the composition step (whose first collective broadcasts the
    weights) must not run."""
    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.engine import entry

    def no_compose(*args, **kwargs):
        raise AssertionError("compose ran: the refusal came after the composition step")

    entry.compose = no_compose
    dsrun.init_distributed()
    model = PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                           loss_fn=torch.nn.functional.mse_loss)
    try:
        dsrun.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}})
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_initialize_refuses_on_every_rank_before_composing():
    for text in run_ranks(_initialize_refused, 2, timeout=180):
        assert combos.SETTINGS["onebit"] in text and combos.SETTINGS["pipeline:1f1b"] in text, text


def test_the_docs_page_is_generated_from_the_table():
    from tests.docs.test_docs import load_hooks
    page = load_hooks().on_page_markdown((ROOT / "docs" / "mesh.md").read_text())
    assert "<!-- generated: combinations -->" not in page
    for pair, entry in combos.TABLE.items():
        a, b = sorted(pair)
        cell = entry.fix if isinstance(entry, combos.Refused) else (f"`{entry.test}`" if entry.test else "untested")
        assert any(line.startswith(f"| `{a}` | `{b}` |") and cell in line for line in page.splitlines()), (a, b)


def test_experts_split_over_the_tensor_ranks_are_refused_up_front():
    """Plain experts beside tensor parallelism work (test_moe_mesh); experts
    made of tensor-parallel layers are named at initialize instead of
    failing inside the first step's gradient norm."""
    from dsrun.runtime.parallel.expert.groups import is_expert_param
    from tests.parallel.test_moe import _Net
    model = _Net(1)
    assert combos.split_experts(model, 2) == []
    expert = next(p for p in model.parameters() if is_expert_param(p))
    expert.tensor_model_parallel = True
    assert combos.split_experts(model, 1) == []
    with pytest.raises(ConfigError, match="split over the tensor ranks") as info:
        combos.check_combinations({"expert", "tensor", "zero:2"}, combos.split_experts(model, 2))
    assert combos.SETTINGS["expert"] in str(info.value) and combos.SETTINGS["tensor"] in str(info.value)


def _experts_accumulating() -> tuple:
    import dsrun
    from tests.parallel.test_moe import _train
    dsrun.init_distributed()
    want = _train(1, None, {"gradient_accumulation_steps": 2})
    got = _train(2, want[2], {"gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 2, "reduce_bucket_size": 64}})
    return want[:2], got[:2]


def test_experts_with_gradient_accumulation_equal_all_experts_local():
    """expert x gradient_accumulation: ep=2 at ZeRO-2 with 2 micro-batches
    per step (4 micro-batches: 2 steps) against the same model with every
    expert local (ep=1, stage 0), on 2 ranks: losses and norms to 1e-5."""
    results = run_ranks(_experts_accumulating, 2, timeout=240)
    for (want_loss, want_norm), (got_loss, got_norm) in results:
        assert want_loss[-1] < want_loss[0]
        assert got_loss == pytest.approx(want_loss, rel=1e-5)
        # The norm of each step, read after its second micro-batch (None before the first step).
        assert got_norm[0] is None and want_norm[0] is None
        assert got_norm[1::2] == pytest.approx(want_norm[1::2], rel=1e-5)
        assert want_norm[1] != want_norm[3]


def _sequence_stages_0_1():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current
    from tests.parallel.test_ulysses import _train
    dsrun.init_distributed()
    want = _train(1)
    out = []
    for stage in (0, 1):
        set_current(None)
        out.append(_train(2, stage=stage))
    return want, out


def test_sequence_with_zero_0_and_1_equals_data_parallel():
    """sequence x zero:0 and sequence x zero:1: sequence 2 x data 2 gives
    data 4's losses and parameters (fp32, test_ulysses's tolerance), as
    test_ulysses checks for stages 2 and 3."""
    from tests.parallel.test_ulysses import TOL
    want, out = run_ranks(_sequence_stages_0_1, 4, timeout=240)[0]
    assert want[0][-1] != want[0][0]
    for got_loss, got_params in out:
        torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want[0]), **TOL)
        torch.testing.assert_close(got_params, want[1], **TOL)


@pytest.mark.parametrize("schedule,virtual,zero_stage", [("interleaved", 2, 1), ("interleaved", 2, 2),
                                                         ("zb-h1", 1, 1)])
def test_pipeline_schedules_with_zero_1_and_2_equal_one_process(schedule, virtual, zero_stage):
    """pipeline:interleaved x zero:1/2 and pipeline:zb-h1 x zero:1: pipe 2 x
    data 2 against one process on the same global batch (test_pipe_engine's
    model, reference and tolerances)."""
    from tests.parallel.test_pipe_engine import _check, _train_pipeline, _train_reference
    results = run_ranks(_train_pipeline, 4, 2, 4, schedule, zero_stage, False, virtual, False)
    _check(results, _train_reference(2, 4, False), rtol=1e-4, atol=1e-5)


def _pipeline_checkpointed(schedule: str, virtual: int) -> dict:
    """test_pipe_engine's pipeline run with `pipeline.activation_checkpoint_interval`
    1 in its config (every layer's forward recomputed in the backward)."""
    from tests.parallel import test_pipe_engine as pe
    plain = pe._config

    def checkpointed(*args):
        cfg = plain(*args)
        return {**cfg, "pipeline": {**cfg["pipeline"], "activation_checkpoint_interval": 1}}

    pe._config = checkpointed
    return pe._train_pipeline(2, 4, schedule, 0, False, virtual, False)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_pipeline_schedules_with_activation_checkpointing_equal_one_process(schedule, virtual):
    """pipeline (each schedule) x activation_checkpointing: pipe 2 x data 2
    with every layer checkpointed against one process without."""
    from tests.parallel.test_pipe_engine import _check, _train_reference
    results = run_ranks(_pipeline_checkpointed, 4, schedule, virtual)
    _check(results, _train_reference(2, 4, False), rtol=1e-4, atol=1e-5)
