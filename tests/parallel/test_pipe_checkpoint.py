"""Checkpoints of the pipeline engine on real gloo ranks: a checkpoint saved
at pipe=2 x data=2 with Adam loads at pipe=1 x data=4, at pipe=4 and into the
plain data-parallel engine over an nn.Sequential of the same layers, weights
and Adam states bit for bit, and training continues with the loss it would
have had without the reshard; ZeRO 0, 1 and 2 on either side; a weight tied
across stages is written once and restored on both stages; `dsrun-ckpt
export` of a pipeline checkpoint gives the plain model's state dict; and
`dsrun-ckpt import-deepspeed` reads DeepSpeed's per-layer pipeline files."""
from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_pipe_engine import CLASSES, MICRO, WIDTH, Block, Head

MICRO_BATCHES = 4  # per step over all data-parallel ranks
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _tied_head(module, x):
    """The output projection through the input layer's weight: (batch, seq, W) -> (batch, W)."""
    return (x @ module.weight).mean(dim=1)


def _layers(tied: bool = False, depth: int = 6):
    from dsrun.pipe import LayerSpec, TiedLayerSpec
    if tied:
        return [TiedLayerSpec("embed", torch.nn.Linear, WIDTH, WIDTH, bias=False), LayerSpec(Block, WIDTH),
                LayerSpec(Block, WIDTH),
                TiedLayerSpec("embed", torch.nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=_tied_head)]
    return [LayerSpec(Block, WIDTH) for _ in range(depth)] + [LayerSpec(Head, WIDTH, CLASSES)]


def _micro_batch(step: int, index: int):
    """Micro-batch `index` (0 .. MICRO_BATCHES-1 over the whole job) of step `step`."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(MICRO, 3, WIDTH, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g)


def _config(data: int, zero_stage: int, async_save: bool = False) -> dict:
    return {"checkpoint": {"async_save": async_save},"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES // data,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 10}},
            "zero_optimization": {"stage": zero_stage}, "steps_per_print": 1000}


def _pipeline_engine(stages: int, zero_stage: int, seed: int, tied: bool = False, async_save: bool = False,
                     depth: int = 6):
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    data = torch.distributed.get_world_size() // stages
    module = PipelineModule(_layers(tied, depth), num_stages=stages, loss_fn=F.cross_entropy, seed_layers=True,
                            base_seed=seed, partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config=_config(data, zero_stage, async_save))
    return engine


def _train_step(engine, step: int):
    """One train_batch over this data rank's share of the step's micro-batches."""
    data_rank, m = engine.grid.get_data_parallel_rank(), engine.micro_batches
    return float(engine.train_batch(iter([_micro_batch(step, data_rank * m + j) for j in range(m)])))


def _full_state(engine) -> dict:
    """name -> {"value", "exp_avg", "exp_avg_sq"}: full fp32 tensors of this rank's parameters."""
    import dsrun
    out = {}
    for name, p in engine.module.named_parameters():
        if engine.strategy.manages(p):
            entry = {"value": dsrun.zero.safe_get_full_fp32_param(p).clone()}
            entry.update({k: dsrun.zero.safe_get_full_optimizer_state(p, k).clone() for k in ADAM_KEYS})
        else:
            state = engine.optimizer.state[p]
            entry = {"value": p.detach().clone(), **{k: state[k].clone() for k in ADAM_KEYS}}
        out[name] = entry
    return out


def _save_then_continue(stages: int, zero_stage: int, ckpt: str, tied: bool = False,
                        async_save: bool = False) -> dict:
    """Train 2 steps, save, then a third step (the run without reshard)."""
    engine = _pipeline_engine(stages, zero_stage, seed=1234, tied=tied, async_save=async_save)
    for step in range(2):
        _train_step(engine, step)
    engine.save_checkpoint(ckpt, client_state={"note": "pipe"})
    engine.save_16bit_model(ckpt + "-16bit")  # every stage's layers, from rank 0
    state = _full_state(engine)
    lr = engine.lr_scheduler.get_last_lr()
    loss3 = _train_step(engine, 2)  # an asynchronous save is still writing what the step changes
    engine.wait_checkpoint()
    return {"state": state, "lr": lr, "loss3": loss3, "stage": engine.stage_id}


def _load_then_continue(stages: int, zero_stage: int, ckpt: str, tied: bool = False) -> dict:
    """Start from other weights, load, then the third step."""
    engine = _pipeline_engine(stages, zero_stage, seed=99, tied=tied)
    _, client = engine.load_checkpoint(ckpt)
    state = _full_state(engine)
    result = {"state": state, "lr": engine.lr_scheduler.get_last_lr(), "client": client,
              "global_steps": engine.global_steps, "stage": engine.stage_id}
    result["loss3"] = _train_step(engine, 2)
    return result


def _load_other_model(ckpt: str) -> str:
    """Load into a pipeline of one block less: the error, on every rank."""
    from dsrun.runtime.checkpoint.store import CheckpointError
    engine = _pipeline_engine(2, 1, seed=99, depth=5)
    with pytest.raises(CheckpointError) as e:
        engine.load_checkpoint(ckpt)
    return str(e.value)


def _plain_load_then_continue(ckpt: str) -> dict:
    """The same layers as an nn.Sequential in the data-parallel engine (one
    rank, every micro-batch by gradient accumulation): load, then step 3."""
    import torch.nn.functional as F

    import dsrun
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    model = torch.nn.Sequential(*[spec.build() for spec in _layers()])
    engine, *_ = dsrun.initialize(model=model, config=_config(1, 0))
    _, client = engine.load_checkpoint(ckpt)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states = {n: {k: engine.optimizer.state[p][k].clone() for k in ADAM_KEYS} for n, p in model.named_parameters()}
    steps = engine.global_steps
    losses = []
    for j in range(MICRO_BATCHES):
        x, y = _micro_batch(2, j)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"weights": weights, "states": states, "client": client, "global_steps": steps,
            "loss3": sum(losses) / len(losses)}


def _merged(results: list[dict]) -> dict:
    """name -> entry over every rank's `state`, checking that ranks holding
    the same parameter agree bit for bit."""
    out = {}
    for r in results:
        for name, entry in r["state"].items():
            if name in out:
                for k, v in entry.items():
                    assert torch.equal(v, out[name][k]), (name, k, "replicas disagree")
            else:
                out[name] = entry
    return out


def _assert_bitwise(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        for k in ("value", *ADAM_KEYS):
            assert torch.equal(got[name][k], want[name][k]), (name, k)


def _index(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "global_step2", "index.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of pipe=2 x data=2, ZeRO 1, after 2 Adam steps, and the run's third step."""
    ckpt = str(tmp_path_factory.mktemp("pipe_ckpt"))
    results = run_ranks(_save_then_continue, 4, 2, 1, ckpt)
    return ckpt, results


@pytest.mark.parametrize("stages,zero_stage", [(1, 2), (4, 0)])
def test_reshard_to_other_pipelines_is_bitwise(saved, stages, zero_stage):
    ckpt, before = saved
    after = run_ranks(_load_then_continue, 4, stages, zero_stage, ckpt)
    _assert_bitwise(_merged(after), _merged(before))
    for r in after:
        assert r["global_steps"] == 2 and r["client"] == {"note": "pipe"}
        assert r["lr"] == before[0]["lr"]
        assert r["loss3"] == pytest.approx(before[0]["loss3"], rel=1e-6, abs=1e-7)


def test_reshard_to_fewer_ranks_and_a_wrong_model(saved):
    """pipe=2 x data=1 reads what pipe=2 x data=2 wrote; a model of other
    layers is refused on every rank, its problems named over every stage."""
    ckpt, before = saved
    after = run_ranks(_load_then_continue, 2, 2, 0, ckpt)
    _assert_bitwise(_merged(after), _merged(before))
    assert after[0]["loss3"] == pytest.approx(before[0]["loss3"], rel=1e-6, abs=1e-7)
    for message in run_ranks(_load_other_model, 2, ckpt):
        assert "size mismatch for 5.linear.weight" in message
        assert "unexpected key(s) in checkpoint: module/6.linear.weight, module/6.linear.bias" in message
        assert "missing" not in message


def test_pipeline_checkpoint_loads_into_the_plain_model(saved):
    ckpt, before = saved
    want = _merged(before)
    (plain,) = run_ranks(_plain_load_then_continue, 1, ckpt)
    assert set(plain["weights"]) == set(want)
    for name, entry in want.items():
        assert torch.equal(plain["weights"][name], entry["value"]), name
        for k in ADAM_KEYS:
            assert torch.equal(plain["states"][name][k], entry[k]), (name, k)
    assert plain["global_steps"] == 2 and plain["client"] == {"note": "pipe"}
    assert plain["loss3"] == pytest.approx(before[0]["loss3"], rel=1e-6, abs=1e-7)


def test_index_names_every_layer_once(saved):
    ckpt, before = saved
    index = _index(ckpt)
    assert index["pipeline_stages"] == 2 and index["world_size"] == 4
    module = {n[len("module/"):]: e for n, e in index["tensors"].items() if n.startswith("module/")}
    assert set(module) == set(_merged(before))
    for name, entry in module.items():  # each element written by exactly one rank
        covered = sorted((s["lo"], s["hi"]) for s in entry["slices"])
        numel = 1
        for d in entry["shape"]:
            numel *= d
        assert covered[0][0] == 0 and covered[-1][1] == numel, name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), name


def test_export_of_a_pipeline_checkpoint_is_the_plain_state_dict(saved, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dsrun.runtime.checkpoint.cli import main as ckpt_cli
    ckpt, before = saved
    result = CliRunner().invoke(ckpt_cli, ["export", ckpt, str(tmp_path / "hf"), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    plain_keys = set(torch.nn.Sequential(*[spec.build() for spec in _layers()]).state_dict())
    assert set(exported) == plain_keys
    for name, entry in _merged(before).items():
        assert torch.equal(exported[name], entry["value"]), name
    written = load_file(ckpt + "-16bit/model.safetensors")  # engine.save_16bit_model (fp32 compute)
    assert list(written) == list(exported)
    for name, value in exported.items():
        assert torch.equal(written[name], value), name


@pytest.mark.parametrize("save_zero,load_zero,async_save", [(0, 2, False), (2, 0, True)])
def test_zero_stages_on_either_side(tmp_path, save_zero, load_zero, async_save):
    ckpt = str(tmp_path / "ckpt")
    before = run_ranks(_save_then_continue, 4, 2, save_zero, ckpt, False, async_save)
    after = run_ranks(_load_then_continue, 4, 1, load_zero, ckpt)
    _assert_bitwise(_merged(after), _merged(before))
    assert after[0]["loss3"] == pytest.approx(before[0]["loss3"], rel=1e-6, abs=1e-7)


def test_tied_weight_is_written_once_and_restored_on_both_stages(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    before = run_ranks(_save_then_continue, 2, 2, 1, ckpt, True)
    assert {r["stage"] for r in before} == {0, 1}
    assert all("tied_modules.embed.weight" in r["state"] for r in before)  # a copy on each stage
    entry = _index(ckpt)["tensors"]["module/tied_modules.embed.weight"]
    assert [(s["file"], s["lo"], s["hi"]) for s in entry["slices"]] == [
        ("rank00000-of-00002.safetensors", 0, WIDTH * WIDTH)]  # by stage 0 only
    from safetensors.torch import load_file
    written = load_file(ckpt + "-16bit/model.safetensors")
    assert set(written) == set(_merged(before))  # the tied weight once
    assert torch.equal(written["tied_modules.embed.weight"], before[0]["state"]["tied_modules.embed.weight"]["value"])
    after = run_ranks(_load_then_continue, 2, 2, 2, ckpt, True)
    for r in after:  # both copies, and their Adam states, are the saved ones
        for k in ("value", *ADAM_KEYS):
            assert torch.equal(r["state"]["tied_modules.embed.weight"][k],
                               before[0]["state"]["tied_modules.embed.weight"][k]), (r["stage"], k)
    _assert_bitwise(_merged(after), _merged(before))
    assert after[0]["loss3"] == pytest.approx(before[0]["loss3"], rel=1e-6, abs=1e-7)


def _deepspeed_pipeline_files(tag_dir, layers: torch.nn.Sequential) -> None:
    """What DeepSpeed's PipelineEngine writes for `layers`: one torch.save'd
    state_dict per layer (`layer_XX-model_states.pt`) and the engine's file
    (`module` None)."""
    os.makedirs(tag_dir)
    for idx, layer in enumerate(layers):
        torch.save(layer.state_dict(), os.path.join(tag_dir, f"layer_{idx:02d}-model_states.pt"))
    torch.save({"module": None, "global_steps": 5, "global_samples": 40, "skipped_steps": 0,
                "ds_config": {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}},
                "lr_scheduler": {"last_batch_iteration": 4}, "dp_world_size": 2, "epoch": 3},
               os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    with open(os.path.join(os.path.dirname(tag_dir), "latest"), "w") as f:
        f.write(os.path.basename(tag_dir))


def _load_imported(ckpt: str, stages: int) -> dict:
    engine = _pipeline_engine(stages, 1, seed=99)
    _, client = engine.load_checkpoint(ckpt, load_optimizer_states=False)
    return {"weights": {n: e["value"] for n, e in _full_state(engine).items()}, "client": client,
            "global_steps": engine.global_steps}


def test_import_deepspeed_pipeline_layers(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dsrun.runtime.checkpoint.cli import main as ckpt_cli
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[spec.build() for spec in _layers()])
    _deepspeed_pipeline_files(str(tmp_path / "ds" / "global_step5"), layers)
    out = str(tmp_path / "dsrun")
    result = CliRunner().invoke(ckpt_cli, ["import-deepspeed", str(tmp_path / "ds"), out])
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(ckpt_cli, ["verify", out]).exit_code == 0
    result = CliRunner().invoke(ckpt_cli, ["export", out, str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = layers.state_dict()
    assert set(exported) == set(want)  # "{XX}.{param}"
    for name, value in want.items():
        assert torch.equal(exported[name], value), name
    loaded = run_ranks(_load_imported, 2, out, 2)
    for r in loaded:
        assert r["global_steps"] == 5 and r["client"] == {"epoch": 3}
        for name, value in r["weights"].items():
            assert torch.equal(value, want[name]), name


def test_import_deepspeed_refuses_tensor_parallel_layers(tmp_path):
    from dsrun.runtime.checkpoint.deepspeed_import import import_deepspeed
    from dsrun.runtime.checkpoint.store import CheckpointError
    tag = tmp_path / "ds" / "step1"
    os.makedirs(tag)
    for tp in (0, 1):
        torch.save({"weight": torch.zeros(2)}, str(tag / f"layer_00-model_{tp:02d}-model_states.pt"))
    with pytest.raises(CheckpointError, match="tensor-parallel rank 1"):
        import_deepspeed(str(tag), str(tmp_path / "out"))
