"""The pipeline engine on real gloo ranks: `train_batch` over pipe x data
gives the losses and weights of the same model trained on the same global
batch in one process, for every schedule, ZeRO stage 0/1/2 and bf16; tied
weights stay equal; shapes may change per micro-batch; `eval_batch`."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks

WIDTH, CLASSES, MICRO, STEPS = 8, 4, 2, 3


class Block(torch.nn.Module):
    """Linear + tanh on the last dimension (any leading shape)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Head(torch.nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.linear(x).mean(dim=1)  # (batch, seq, classes) -> (batch, classes)


def _layers(depth: int = 6):
    from dsrun.pipe import LayerSpec
    return [LayerSpec(Block, WIDTH) for _ in range(depth)] + [LayerSpec(Head, WIDTH, CLASSES)]


def _reference_model(depth: int = 6) -> torch.nn.Sequential:
    """The same layers in one process, seeded as PipelineModule(seed_layers=True) seeds them."""
    from dsrun.runtime.utils import set_random_seed
    layers = []
    for idx, spec in enumerate(_layers(depth)):
        set_random_seed(1234 + idx)
        layers.append(spec.build())
    return torch.nn.Sequential(*layers)


def _micro_batch(step: int, data_rank: int, micro: int, seq: int = 3):
    g = torch.Generator().manual_seed(1000 * step + 100 * data_rank + micro)
    seq = seq if seq else 2 + (micro % 3)
    x = torch.randn(MICRO, seq, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (MICRO,), generator=g)
    return x, y


def _config(stages: int, data: int, micro_batches: int, schedule: str, zero_stage: int, bf16: bool,
            virtual: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": bf16},
            "gradient_clipping": 1.0, "pipeline": {"schedule": schedule, "virtual_stages": virtual},
            "steps_per_print": 1000}


def _train_pipeline(stages: int, micro_batches: int, schedule: str, zero_stage: int, bf16: bool,
                    virtual: int, variable_seq: bool, release_graph: bool = False) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    world = torch.distributed.get_world_size()
    module = PipelineModule(_layers(), num_stages=stages, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform", virtual_stages=virtual)
    engine, *_ = dsrun.initialize(model=module, config=_config(stages, world // stages, micro_batches, schedule,
                                                                zero_stage, bf16, virtual))
    if release_graph:  # zb-h1's input pass frees the graph, as it does on a GPU
        engine.release_graph_in_input_pass = True
    data_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        batches = iter([_micro_batch(step, data_rank, j, seq=0 if variable_seq else 3)
                        for j in range(micro_batches)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(engine.get_global_grad_norm())
    weights = {}
    for name, p in module.named_parameters():
        full = dsrun.zero.safe_get_full_fp32_param(p) if engine.strategy.manages(p) else p.detach().float()
        weights[name] = full.clone()
    return {"losses": losses, "norms": norms, "weights": weights, "stage": engine.stage_id, "data": data_rank}


def _train_reference(data: int, micro_batches: int, variable_seq: bool, optimizer=None) -> dict:
    """One process: `optimizer` (a function of the parameters; SGD lr 0.5 when None) on the global batch."""
    import torch.nn.functional as F
    model = _reference_model()
    opt = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(data):
            for j in range(micro_batches):
                x, y = _micro_batch(step, d, j, seq=0 if variable_seq else 3)
                loss = F.cross_entropy(model(x), y) / (data * micro_batches)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _check(results: list[dict], reference: dict, rtol: float, atol: float) -> None:
    for r in results:
        assert r["losses"] == pytest.approx(reference["losses"], rel=rtol, abs=atol), r
        # the norm spans every stage (clipping uses the whole model's)
        assert r["norms"] == pytest.approx(reference["norms"], rel=rtol, abs=atol), r
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, reference["weights"][name], rtol=rtol, atol=atol, msg=name)
    held = {name for r in results for name in r["weights"]}
    assert held == set(reference["weights"]), "every layer lives on some stage"


@pytest.mark.parametrize("schedule,stages,micro_batches,virtual,release_graph", [
    ("1f1b", 2, 4, 1, False), ("zb-h1", 2, 4, 1, False), ("zb-h1", 2, 4, 1, True), ("interleaved", 2, 4, 2, False),
    ("1f1b", 4, 4, 1, False)])
def test_pipeline_matches_one_process_training(schedule, stages, micro_batches, virtual, release_graph):
    data = 4 // stages
    results = run_ranks(_train_pipeline, 4, stages, micro_batches, schedule, 0, False, virtual, False, release_graph)
    _check(results, _train_reference(data, micro_batches, False), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_pipeline_with_zero_stages(zero_stage):
    results = run_ranks(_train_pipeline, 4, 2, 4, "1f1b", zero_stage, False, 1, False)
    _check(results, _train_reference(2, 4, False), rtol=1e-4, atol=1e-5)


def test_pipeline_bf16_zero2_and_variable_sequence_lengths():
    """bf16 compute with fp32 masters, and micro-batches whose sequence length
    changes (metadata is sent whenever the shapes change)."""
    results = run_ranks(_train_pipeline, 4, 2, 4, "1f1b", 2, True, 1, True)
    _check(results, _train_reference(2, 4, True), rtol=5e-2, atol=5e-2)


class Tied(torch.nn.Module):
    """A square weight used twice: x @ W here, x @ W^T at the other end."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        return x @ self.weight


def _transposed(module, x):
    return x @ module.weight.t()


def _tied_layers():
    from dsrun.pipe import LayerSpec, TiedLayerSpec
    return ([TiedLayerSpec("square", Tied, WIDTH)] + [LayerSpec(Block, WIDTH) for _ in range(4)]
            + [TiedLayerSpec("square", Tied, WIDTH, forward_fn=_transposed), LayerSpec(Head, WIDTH, CLASSES)])


class _TiedReference(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from dsrun.runtime.utils import set_random_seed
        built = []
        for idx, spec in enumerate(_tied_layers()):
            set_random_seed(1234 + idx)
            built.append(None if idx == 5 else spec.build())
        self.tied, self.blocks, self.head = built[0], torch.nn.ModuleList(built[1:5]), built[6]

    def forward(self, x):
        x = self.tied(x)
        for block in self.blocks:
            x = block(x)
        return self.head(_transposed(self.tied, x))


def _train_tied(stages: int, schedule: str, zero_stage: int) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_tied_layers(), num_stages=stages, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config=_config(stages, 4 // stages, 2, schedule, zero_stage, False, 1))
    data_rank = engine.grid.get_data_parallel_rank()
    losses = [float(engine.train_batch(iter([_micro_batch(s, data_rank, j) for j in range(2)])))
              for s in range(STEPS)]
    tied = module.tied_modules["square"].weight if "square" in module.tied_modules else None
    eval_batches = [_micro_batch(99, data_rank, j) for j in range(2)]
    eval_loss, logits = engine.eval_batch(iter(eval_batches), return_logits=True)
    return {"losses": losses, "tied": None if tied is None else dsrun.zero.safe_get_full_fp32_param(tied).clone(),
            "eval": float(eval_loss), "logits": logits, "stage": engine.stage_id}


@pytest.mark.parametrize("schedule,zero_stage", [("1f1b", 1), ("zb-h1", 2)])
def test_tied_weights_and_eval_batch(schedule, zero_stage):
    """A weight used by the first and the last stage: its gradient is summed
    over both, the copies stay equal, the losses are one process's; then
    eval_batch gives the forward loss on every stage and the logits on the last.
    Under zb-h1 the tied weight's transposed use (a forward_fn, no module
    output to record) takes the weight pass's fallback path."""
    import torch.nn.functional as F
    results = run_ranks(_train_tied, 4, 2, schedule, zero_stage)
    model = _TiedReference()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(2):
            for j in range(2):
                x, y = _micro_batch(step, d, j)
                loss = F.cross_entropy(model(x), y) / 4
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    with torch.no_grad():
        evals = [[F.cross_entropy(model(x), y).item() for x, y in (_micro_batch(99, d, j) for j in range(2))]
                 for d in range(2)]
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-5)
        assert r["tied"] is not None, "stages 0 and 1 both hold the tied weight"
        torch.testing.assert_close(r["tied"], model.tied.weight.detach(), rtol=1e-4, atol=1e-5)
        assert r["eval"] == pytest.approx(sum(map(sum, evals)) / 4, rel=1e-4)
        assert (r["logits"] is None) == (r["stage"] == 0)
        if r["logits"] is not None:
            assert len(r["logits"]) == 2 and r["logits"][0].shape == (MICRO, CLASSES)


def _empty_stage_layers():
    from dsrun.pipe import LayerSpec
    # stages 2 and 3 hold one parameterless layer each
    return [LayerSpec(Block, WIDTH), LayerSpec(Head, WIDTH, CLASSES), torch.nn.Tanh(), torch.nn.Identity()]


def _train_with_empty_stage() -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_empty_stage_layers(), num_stages=4, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config=_config(4, 1, 4, "1f1b", 0, False, 1))
    losses = [float(engine.train_batch(iter([_micro_batch(s, 0, j) for j in range(4)]))) for s in range(STEPS)]
    return {"losses": losses, "params": sum(p.numel() for p in module.parameters())}


def test_stage_without_parameters():
    """Stages 2 and 3 of 4 hold no parameter (an optimizer of one empty
    group); the run still equals one process's."""
    import torch.nn.functional as F

    from dsrun.runtime.utils import set_random_seed
    results = run_ranks(_train_with_empty_stage, 4)
    assert [r["params"] > 0 for r in results] == [True, True, False, False]
    layers = []
    for idx, spec in enumerate(_empty_stage_layers()):
        set_random_seed(1234 + idx)
        layers.append(spec.build() if hasattr(spec, "build") else spec)
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for j in range(4):
            x, y = _micro_batch(step, 0, j)
            loss = F.cross_entropy(model(x), y) / 4
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-5)


def _train_fp16(zero_stage: int) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    cfg = _config(2, 2, 2, "1f1b", zero_stage, False, 1)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 1000}
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    data_rank = engine.grid.get_data_parallel_rank()
    losses, scales = [], []
    for s in range(8):
        losses.append(float(engine.train_batch(iter([_micro_batch(0, data_rank, j) for j in range(2)]))))
        scales.append(engine.strategy.loss_scale())
    return {"losses": losses, "scales": scales, "skipped": engine.skipped_steps}


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_fp16_one_loss_scale_across_stages(zero_stage):
    """fp16 with a loss scale so large that the first steps overflow: every
    stage skips the same steps and keeps the same scale, then training goes on."""
    results = run_ranks(_train_fp16, 4, zero_stage)
    assert len({(tuple(r["scales"]), r["skipped"]) for r in results}) == 1, results
    r = results[0]
    assert r["skipped"] >= 1 and r["scales"][0] < 2.0 ** 18
    applied = [loss for loss, scale, prev in zip(r["losses"][1:], r["scales"][1:], r["scales"]) if scale == prev]
    assert applied and all(map(lambda v: v == v and abs(v) < 10, r["losses"]))
    assert r["losses"][-1] < r["losses"][0], "the same batch every step: the loss falls once steps apply"


def test_config_must_match_the_module():
    """Keys the module decided before the config was read are checked, not ignored."""
    from types import SimpleNamespace

    from dsrun.runtime.config import ConfigError, load_config
    from dsrun.runtime.engine.pipeline_engine import check_pipeline_config
    module = SimpleNamespace(num_stages=2, partition_method="parameters", seed_layers=False, virtual_stages=1,
                             activation_checkpoint_interval=0)
    base = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    check_pipeline_config(load_config({**base, "pipeline": {"stages": 2}}, world_size=2), module)
    for section, words in [({"stages": 4}, "stages=4"), ({"partition": "uniform"}, "partition"),
                           ({"seed_layers": True}, "seed_layers"), ({"schedule": "interleaved"}, "interleaved"),
                           ({"virtual_stages": 2}, "virtual_stages=2")]:
        with pytest.raises(ConfigError, match=words):
            check_pipeline_config(load_config({**base, "pipeline": section}, world_size=2), module)
    check_pipeline_config(load_config({**base, "pipeline": {"activation_checkpoint_interval": 3}}, world_size=2),
                          module)
    assert module.activation_checkpoint_interval == 3, "a set interval replaces the module's, as in DeepSpeed"


def test_zero3_with_the_zero_bubble_schedule_is_refused():
    """Refused when the config meets the pipeline: stage 3 cannot split a
    backward into zero bubble's input and weight passes (stage 3 with the
    other schedules trains: tests/parallel/test_pipe_zero.py)."""
    from types import SimpleNamespace

    from dsrun.runtime.config import ConfigError, load_config
    from dsrun.runtime.engine.pipeline_engine import check_pipeline_config
    module = SimpleNamespace(num_stages=2, partition_method="parameters", seed_layers=False, virtual_stages=1,
                             activation_checkpoint_interval=0)
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3},
                       "pipeline": {"schedule": "zb-h1"}}, world_size=2)
    with pytest.raises(ConfigError, match="zb-h1.*stage=3 is not supported"):
        check_pipeline_config(cfg, module)
    check_pipeline_config(load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}}, world_size=2),
                          module)


def _train_with_csv_monitor(out_dir: str) -> float:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    cfg = _config(2, 1, 2, "1f1b", 0, False, 1)
    cfg["csv_monitor"] = {"enabled": True, "output_path": out_dir, "job_name": "pipe"}
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    return float(engine.train_batch(iter([_micro_batch(0, 0, j) for j in range(2)])))


def test_monitor_reports_the_last_stages_loss(tmp_path):
    """Rank 0 (the first stage, which computes no loss) writes the step's loss."""
    losses = run_ranks(_train_with_csv_monitor, 2, str(tmp_path))
    files = {f.name: f for f in tmp_path.rglob("*.csv")}
    name = next(n for n in files if "loss" in n.lower())
    rows = files[name].read_text().strip().splitlines()
    assert float(rows[-1].split(",")[-1]) == pytest.approx(losses[0], rel=1e-6)


def _train_counting_step_end(stages: int, zero_stage: int = 0) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.comm import comms_logger
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    world = torch.distributed.get_world_size()
    module = PipelineModule(_layers(), num_stages=stages, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config=_config(stages, world // stages, 4, "1f1b", zero_stage, False,
                                                                1))
    data_rank = engine.grid.get_data_parallel_rank()
    losses, calls = [], []
    for step in range(STEPS):
        before = comms_logger.snapshot()
        losses.append(float(engine.train_batch(iter([_micro_batch(step, data_rank, j) for j in range(4)]))))
        after = comms_logger.snapshot()
        calls.append({op: s.calls - (before[op].calls if op in before else 0) for op, s in after.items()})
    return {"losses": losses, "calls": calls, "norm": engine.get_global_grad_norm(), "stage": engine.stage_id}


@pytest.mark.parametrize("stages", [2, 4])
def test_step_loss_travels_with_the_gradient_norm(stages):
    """The step's loss reaches every stage in the gradient norm's all-reduce
    over the stages ([Note: the step's end]): no broadcast, and every rank
    returns the same loss, that of one-process training. Pipe 4 (no
    replicas) issues that one collective per step and nothing else (no
    gradient all-reduce over a one-rank group)."""
    results = run_ranks(_train_counting_step_end, 4, stages)
    reference = _train_reference(4 // stages, 4, False)
    for r in results:
        assert all(c.get("broadcast", 0) == 0 for c in r["calls"]), r["calls"]
        if stages == 4:
            assert all(c.get("all_reduce", 0) == 1 for c in r["calls"]), r["calls"]
        assert r["losses"] == results[0]["losses"]  # bit-identical on every stage and replica
        assert r["norm"] == results[0]["norm"]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("zero_stage,shm,all_reduces", [(1, False, (4, 5)), (2, False, (7, 8)), (1, True, (2, 3)),
                                                       (2, True, (2, 3))])
def test_zero_norm_carries_the_stage_duplicates(monkeypatch, zero_stage, shm, all_reduces):
    """With ZeRO 1/2 in a pipeline the squared norm of a stage's duplicate
    gradients rides in the shard group's norm all-reduce (it had one of its
    own: 5 / 6 and 8 / 9 all-reduces per step on the first / last stage
    before, on gloo, where ZeRO's reduce-scatters and all-gathers are
    all-reduces; shared memory runs those natively, leaving 2 / 3); losses
    still those of one-process training, equal on every rank."""
    if not shm:
        monkeypatch.setenv("DSRUN_SHM_COMM", "0")
    results = run_ranks(_train_counting_step_end, 4, 2, zero_stage)
    reference = _train_reference(2, 4, False)
    for r in results:
        assert all(c.get("all_reduce", 0) == all_reduces[r["stage"]] for c in r["calls"]), r["calls"]
        assert r["losses"] == results[0]["losses"]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
