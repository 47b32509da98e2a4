"""engine.save_checkpoint / load_checkpoint on real gloo ranks.

One spawn saves every case on 2 ranks (and checks same-size resume, the
failed save and the errors); one spawn per world size (1, 2, 4) then loads
every checkpoint at another stage and returns the full fp32 parameters and
Adam states, which must equal the saved ones exactly.
"""
import json
import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches, param_groups

# (name, stage, precision, model kwargs) saved on 2 ranks; "native": ds_config's
# AdamW (dsrun's fused Adam step) instead of a torch.optim.AdamW object.
CASES = [
    ("s0_fp32", 0, "fp32", {}),
    ("s1_native", 1, "fp32", {"native": True}),
    ("s1_fp32", 1, "fp32", {}),
    ("s2_fp32", 2, "fp32", {}),
    ("s3_fp32", 3, "fp32", {"freeze": True}),
    ("s3_bf16", 3, "bf16", {"freeze": True}),
    ("s2_fp16", 2, "fp16", {}),
    ("s0_bf16", 0, "bf16", {}),  # replicated 16-bit: each rank writes half of every slice
]
SMALL = {"reduce_bucket_size": 300, "allgather_bucket_size": 700, "stage3_param_persistence_threshold": 40}


def _engine(stage, precision, model_kwargs, seed=0, native=False):
    import dsrun

    model_kwargs = dict(model_kwargs)
    native = native or model_kwargs.pop("native", False)
    torch.manual_seed(seed)
    model = TinyGPT(**model_kwargs)
    cfg = base_config(stage, precision, **SMALL)
    if native:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
        engine, *_ = dsrun.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    else:
        engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
                                      config=cfg)
    return engine


def _run(engine, data):
    from dsrun.runtime import comm

    losses = []
    for idx, tgt in data:
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        comm.all_reduce(t)
        losses.append(t.item())
    return losses


def _full_state(engine):
    """{name: fp32 value}, {name/key: fp32 Adam state} over all ranks (collective)."""
    from dsrun.runtime.zero.strategy import ZeroStrategy

    strategy = engine.strategy
    params, states = {}, {}
    for n, p in engine.module.named_parameters():
        full = strategy.full_fp32_param(p) if isinstance(strategy, ZeroStrategy) else None
        if full is not None:  # managed by ZeRO
            params[n] = full.cpu().clone()
            if p.requires_grad:
                for k in ("exp_avg", "exp_avg_sq"):
                    states[f"{n}/{k}"] = strategy.full_optimizer_state(p, k).cpu().clone()
        else:
            params[n] = p.detach().float().cpu().clone()
            st = engine.optimizer.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    states[f"{n}/{k}"] = st[k].float().cpu().clone()
    return params, states


def _save_rank(root):
    """2 ranks: save every case after 2 steps; resume on the same size; failures."""
    from dsrun.runtime.checkpoint import CheckpointError, checkpointer
    from dsrun.runtime.checkpoint.reader import SliceReader

    rank = int(os.environ["RANK"])  # before initialize
    data = batches(rank, 4, 2, 1)
    out = {}
    for name, stage, prec, kw in CASES:
        engine = _engine(stage, prec, kw)
        first = _run(engine, data[:2])
        engine.save_checkpoint(os.path.join(root, name), client_state={"epoch": 3, "t": torch.arange(4.0)})
        ref = _full_state(engine)
        if name in ("s0_fp32", "s3_bf16"):
            engine.save_16bit_model(os.path.join(root, f"export_{name}"))
        rest = _run(engine, data[2:])
        # Same world size, same stage: a fresh engine (other init) resumes bitwise.
        resumed = _engine(stage, prec, kw, seed=123)
        opened, read_file = [], SliceReader._read_file  # which files this rank reads
        SliceReader._read_file = lambda self, file, wanted: (opened.append(file), read_file(self, file, wanted))
        try:
            path, client = resumed.load_checkpoint(os.path.join(root, name))
        finally:
            SliceReader._read_file = read_file
        assert path.endswith("global_step2") and client["epoch"] == 3
        assert torch.equal(client["t"], torch.arange(4.0))
        assert resumed.global_steps == 2 and resumed.global_samples == engine.global_samples // 2
        out[name] = {"ref": ref, "first": first, "rest": rest, "resumed": _run(resumed, data[2:]), "read": opened}
    # A save that fails on rank 1 after its shard leaves `latest` and the old tag alone.
    engine = _engine(1, "fp32", {})
    _run(engine, data[:1])
    root2 = os.path.join(root, "crash")
    engine.save_checkpoint(root2, tag="good")
    good = _full_state(engine)
    _run(engine, data[1:2])
    checkpointer.fault_hook = (lambda point: (_ for _ in ()).throw(OSError("injected")) if
                               point == "after_shard" and rank == 1 else None)
    try:
        engine.save_checkpoint(root2, tag="bad")
        raise AssertionError("the failed save did not raise")
    except (CheckpointError, OSError) as e:
        out["crash_error"] = str(e)
    finally:
        checkpointer.fault_hook = None
    fresh = _engine(1, "fp32", {}, seed=5)
    path, _ = fresh.load_checkpoint(root2)
    out["crash_loaded"] = os.path.basename(path)
    out["crash_equal"] = all(torch.equal(a, b) for a, b in zip(good[0].values(), _full_state(fresh)[0].values()))
    # Failing on either rank, before or after its shard, or after the index: no file of the tag stays.
    for point, victim in (("before_shard", 0), ("before_latest", 0)):
        checkpointer.fault_hook = (lambda p, point=point, victim=victim: (_ for _ in ()).throw(OSError("injected"))
                                   if p == point and rank == victim else None)
        try:
            engine.save_checkpoint(root2, tag=f"bad_{point}")
            raise AssertionError("the failed save did not raise")
        except (CheckpointError, OSError):
            pass
        finally:
            checkpointer.fault_hook = None
        out[f"crash_left_{point}"] = os.path.exists(os.path.join(root2, f"bad_{point}"))
    out["api"] = _api_cases(root, data)
    # A checkpoint of another model: precise key errors.
    other = _engine(2, "fp32", {"layers": 3})
    try:
        other.load_checkpoint(os.path.join(root, "s2_fp32"))
        raise AssertionError("another model loaded")
    except CheckpointError as e:
        out["other_error"] = str(e)
    wide = _engine(2, "fp32", {"d": 8})
    try:
        wide.load_checkpoint(os.path.join(root, "s2_fp32"))
        raise AssertionError("another shape loaded")
    except CheckpointError as e:
        out["shape_error"] = str(e)
    return out


def _api_cases(root, data):
    """DeepSpeed's load/save options and their errors (2 ranks, stage 3, frozen block)."""
    from dsrun.runtime.checkpoint import CheckpointError

    res = {"empty": _engine(3, "fp32", {"freeze": True}).load_checkpoint(os.path.join(root, "nothing"))}
    src = os.path.join(root, "s3_fp32")
    engine = _engine(3, "fp32", {"freeze": True}, seed=9)
    try:
        engine.load_checkpoint(src, tag="global_step7")
    except CheckpointError as e:
        res["missing_tag"] = str(e)
    path, client = engine.load_checkpoint(src, load_module_only=True)
    res["module_only"] = (engine.global_steps, len(engine.optimizer.state), client)
    res["module_only_params"] = _full_state(engine)[0]
    # exclude_frozen_parameters: the frozen block is not saved; strict loading accepts that.
    engine = _engine(3, "fp32", {"freeze": True}, seed=9)
    _run(engine, data[:1])
    frozen_before = _full_state(engine)[0]["h.0.fc.weight"]
    engine.save_checkpoint(os.path.join(root, "nofrozen"), exclude_frozen_parameters=True)
    other = _engine(3, "fp32", {"freeze": True}, seed=10)
    other.load_checkpoint(os.path.join(root, "nofrozen"))
    after = _full_state(other)[0]
    res["frozen_kept"] = not torch.equal(after["h.0.fc.weight"], frozen_before)  # the new model's own
    res["trained_loaded"] = torch.equal(after["h.1.fc.weight"], _full_state(engine)[0]["h.1.fc.weight"])

    # The engine's data loader resumes at the next micro-batch.
    from torch.utils.data import TensorDataset

    from dsrun.runtime.engine.dataloader import DistributedDataLoader
    dataset = TensorDataset(torch.arange(40.0))
    engine.training_dataloader = DistributedDataLoader(dataset, 2, engine.topology, seed=4)
    next(iter(engine.training_dataloader))  # epoch 0 done (only its first batch used)
    it = iter(engine.training_dataloader)
    seen = [next(it)[0] for _ in range(3)]  # epoch 1, batches 0-2
    engine.save_checkpoint(os.path.join(root, "loader"))
    expected = next(it)[0]
    other = _engine(3, "fp32", {"freeze": True}, seed=10)
    other.training_dataloader = DistributedDataLoader(dataset, 2, other.topology, seed=4)
    other.load_checkpoint(os.path.join(root, "loader"))
    resumed = next(iter(other.training_dataloader))[0]
    res["loader"] = (torch.equal(resumed, expected), not any(torch.equal(resumed, s) for s in seen),
                     other.training_dataloader.epoch)

    # LR schedulers: ds_config's WarmupLR and a torch StepLR object continue where they were.
    import dsrun
    for kind in ("warmup", "steplr"):
        runs = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = TinyGPT()
            cfg = base_config(1)
            opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
            sched = None
            if kind == "warmup":
                cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
            else:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            e, *_ = dsrun.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
            runs.append(e)
        _run(runs[0], data[:2])
        runs[0].save_checkpoint(os.path.join(root, f"sched_{kind}"))
        runs[1].load_checkpoint(os.path.join(root, f"sched_{kind}"))
        res[f"sched_{kind}"] = (runs[0].get_lr() == runs[1].get_lr(),
                                runs[0].lr_scheduler.state_dict() == runs[1].lr_scheduler.state_dict(),
                                _run(runs[0], data[2:3]) == _run(runs[1], data[2:3]), runs[1].get_lr())
    # checkpoint.keep_last: the oldest complete tags go, their files deleted
    # after the save returned (held back here until the listing is taken).
    import threading

    from dsrun.runtime.checkpoint import discard
    from dsrun.runtime.checkpoint.store import tag_names
    keep, go, delete = os.path.join(root, "keep"), threading.Event(), discard._delete
    discard._delete = lambda dirs: (go.wait(), delete(dirs))
    engine.config.checkpoint.keep_last = 2
    for step in range(3):
        engine.save_checkpoint(keep, tag=f"t{step}")
    engine.save_checkpoint(keep, tag="t2")  # overwriting: the old shards are discarded too
    engine.config.checkpoint.keep_last = None
    res["kept_at_return"] = (tag_names(keep), sorted(os.listdir(keep)))
    go.set()
    discard.wait()
    discard._delete = delete
    res["kept"] = sorted(os.listdir(keep))
    res["kept_t2"] = sorted(os.listdir(os.path.join(keep, "t2")))

    class Opaque:  # an LR scheduler whose state JSON cannot hold
        def state_dict(self):
            return {"fn": object()}

    engine.lr_scheduler = Opaque()
    try:
        engine.save_checkpoint(os.path.join(root, "nofrozen"), tag="opaque")
    except CheckpointError as e:
        res["scheduler_error"] = str(e)
    with open(os.path.join(root, "nofrozen", "latest")) as f:
        res["latest_after_error"] = f.read()
    return res


# Where each saved case is loaded, per world size: (stage, precision).
TARGETS = {1: {"*": (0, "fp32")}, 2: {"s0_fp32": (3, "fp32"), "s1_fp32": (2, "bf16"), "s1_native": (0, "bf16"),
                                     "s2_fp32": (3, "bf16"),
                                     "s3_fp32": (1, "fp32"), "s3_bf16": (0, "fp32"), "s2_fp16": (3, "fp32"),
                                     "s0_bf16": (2, "fp32")},
           4: {"*": (3, "fp32")}}


def _load_rank(root, world):
    out = {}
    data = batches(0, 1, 2, 1)
    for name, stage, prec, kw in CASES:
        s, p = TARGETS[world].get(name, TARGETS[world].get("*"))
        engine = _engine(s, p, kw, seed=77)
        engine.load_checkpoint(os.path.join(root, name))
        out[name] = _full_state(engine)
        _run(engine, data)  # training continues
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(_save_rank, 2, root, timeout=300)[0]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_same_size_resume_is_bitwise(saved, name):
    _, out = saved
    r = out[name]
    assert r["resumed"] == r["rest"]  # bitwise (loss scale and step counts restored)
    # Every rank holds its own file's slices, so rank 0 reads only its own file,
    # at stage 0 too (the other rank's replicated part is broadcast, not re-read).
    assert set(r["read"]) == {"rank00000-of-00002.safetensors"}, r["read"]


def test_index_records_format(saved):
    root, _ = saved
    tag_dir = os.path.join(root, "s3_bf16", "global_step2")
    with open(os.path.join(root, "s3_bf16", "latest")) as f:
        assert f.read() == "global_step2"
    files = sorted(os.listdir(tag_dir))
    assert files == ["index.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    with open(os.path.join(tag_dir, "index.json")) as f:
        index = json.load(f)
    assert index["world_size"] == 2 and index["stage"] == 3 and index["precision"] == "bf16"
    assert index["counters"]["global_steps"] == 2
    w = index["tensors"]["module/h.1.fc.weight"]
    assert w["shape"] == [32, 16] and w["dtype"] == "float32"
    assert sorted((s["lo"], s["hi"]) for s in w["slices"]) == [(0, 256), (256, 512)]
    frozen = index["tensors"]["module/h.0.fc.weight"]
    assert frozen["dtype"] == "bfloat16" and "optim/h.0.fc.weight/exp_avg" not in index["tensors"]
    assert index["optimizer_scalars"]["h.1.fc.weight"]["step"]["value"] == 2.0
    with open(os.path.join(root, "s0_bf16", "global_step2", "index.json")) as f:
        replicated = json.load(f)["tensors"]["optim/h.1.fc.weight/exp_avg"]  # every rank holds it all
    assert sorted((s["lo"], s["hi"], s["file"][:9]) for s in replicated["slices"]) == [
        (0, 256, "rank00000"), (256, 512, "rank00001")]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_load_on_other_world_size_and_stage(saved, world):
    root, out = saved
    loaded = run_ranks(_load_rank, world, root, world, timeout=300)[0]
    for name, stage, prec, kw in CASES:
        ref_params, ref_states = out[name]["ref"]
        params, states = loaded[name]
        s, p = TARGETS[world].get(name, TARGETS[world].get("*"))
        assert params.keys() == ref_params.keys()
        for n, v in params.items():
            frozen = kw.get("freeze") and n.startswith("h.0.")
            if frozen and (p != "fp32" or prec != "fp32"):
                torch.testing.assert_close(v, ref_params[n], rtol=1e-2, atol=1e-2, msg=f"{name} {n}")
            else:
                assert torch.equal(v, ref_params[n]), f"{name}: {n} differs after loading on {world} ranks"
        assert states.keys() == ref_states.keys()
        for k, v in states.items():
            assert torch.equal(v, ref_states[k]), f"{name}: optimizer state {k} differs on {world} ranks"


def test_failed_save_keeps_latest(saved):
    root, out = saved
    assert "injected" in out["crash_error"] or "rank(s) [1]" in out["crash_error"]
    assert out["crash_loaded"] == "good" and out["crash_equal"]
    crash = os.path.join(root, "crash")
    with open(os.path.join(crash, "latest")) as f:
        assert f.read() == "good"
    # Rank 0's shard landed before rank 1 failed: every file of the tag went, and its directory.
    assert sorted(os.listdir(crash)) == ["good", "latest"]
    assert not out["crash_left_before_shard"] and not out["crash_left_before_latest"]
    from dsrun.runtime.checkpoint import resolve_tag
    assert resolve_tag(crash, None) == ("good", [])
    os.unlink(os.path.join(crash, "latest"))  # no `latest`: the newest complete tag
    assert resolve_tag(crash, None) == ("good", [])


def test_other_model_names_the_key(saved):
    _, out = saved
    assert "missing key(s) in checkpoint: module/h.2.ln.weight" in out["other_error"]
    assert "size mismatch for wte.weight" in out["shape_error"]


def _load_corrupt(root):
    engine = _engine(2, "fp32", {})
    return engine.load_checkpoint(root)


def _load_corrupt_error(root):
    from dsrun.runtime.checkpoint import CheckpointError
    try:
        _load_corrupt(root)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_corrupted_shard_names_the_file(saved, tmp_path):
    import shutil

    from tests.dist_helpers import RankFailed
    root, _ = saved
    copy = tmp_path / "s2"
    shutil.copytree(os.path.join(root, "s2_fp32"), copy)
    shard = copy / "global_step2" / "rank00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(RankFailed, match="rank00001-of-00002.safetensors is corrupted"):
        run_ranks(_load_corrupt, 1, str(copy), timeout=120)
    # On 2 ranks rank 1 checks that file; rank 0 fails too, naming it.
    errors = run_ranks(_load_corrupt_error, 2, str(copy), timeout=120)
    assert all("rank00001-of-00002.safetensors is corrupted" in e for e in errors), errors
    shard.write_bytes(bytes(raw[:-100]))
    with pytest.raises(RankFailed, match="rank00001-of-00002.safetensors is truncated"):
        run_ranks(_load_corrupt, 1, str(copy), timeout=120)


def test_zero_to_fp32_and_16bit_export(saved):
    from safetensors.torch import load_file

    from dsrun.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
    root, out = saved
    for name, dtype in (("s0_fp32", torch.float32), ("s3_bf16", torch.bfloat16)):
        ref = out[name]["ref"][0]
        sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, name))
        assert sd.keys() == ref.keys()
        frozen = name == "s3_bf16"
        for n, v in sd.items():
            assert v.dtype == torch.float32
            if frozen and n.startswith("h.0."):  # frozen: stored in bf16
                assert torch.equal(v, ref[n].to(torch.bfloat16).float())
            else:
                assert torch.equal(v, ref[n]), n
        exported = load_file(os.path.join(root, f"export_{name}", "model.safetensors"))
        assert exported.keys() == ref.keys()
        for n, v in exported.items():
            assert v.dtype == dtype and torch.equal(v, ref[n].to(dtype)), n
    kw = dict(CASES[[c[0] for c in CASES].index("s3_bf16")][3])
    kw.pop("native", None)
    model = load_state_dict_from_zero_checkpoint(TinyGPT(**kw), os.path.join(root, "s3_bf16"))
    assert torch.equal(model.h[1].fc.weight.detach(), out["s3_bf16"]["ref"][0]["h.1.fc.weight"])
    assert model.head.weight is model.wte.weight  # tied: loaded once, still tied
    without = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "s3_bf16"), "global_step2",
                                                       exclude_frozen_parameters=True)
    assert not [n for n in without if n.startswith("h.0.")] and "h.1.fc.weight" in without


def _one_rank_calls(root):
    import time

    from dsrun.runtime import comm
    from dsrun.runtime.checkpoint import CheckpointError, checkpointer

    checkpointer.ARRIVAL_TIMEOUT_S = 2.0
    engine = _engine(0, "fp32", {})
    start = time.monotonic()
    try:
        if comm.get_rank() == 1:
            engine.save_checkpoint(root)
        else:
            engine.load_checkpoint(os.path.join(root, "s0_fp32"))
    except CheckpointError as e:
        return str(e), time.monotonic() - start
    return "no error", None


def test_save_or_load_on_one_rank_fails_fast(saved):
    """Rank 1 saves while rank 0 loads: neither hangs, both name the call."""
    root, _ = saved
    (load_err, t0), (save_err, t1) = run_ranks(_one_rank_calls, 2, root, timeout=120)
    assert "load_checkpoint must be called on every rank: only 1 of 2" in load_err
    assert "save_checkpoint must be called on every rank: only 1 of 2" in save_err
    assert t0 < 30 and t1 < 30


def test_load_options_and_errors(saved):
    _, out = saved
    api = out["api"]
    assert api["empty"] == (None, None)
    assert "global_step7 does not exist" in api["missing_tag"]
    assert api["module_only"] == (0, 0, {})  # no counters, no optimizer state, no client_state
    ref = out["s3_fp32"]["ref"][0]
    assert all(torch.equal(v, ref[n]) for n, v in api["module_only_params"].items())
    assert api["frozen_kept"] and api["trained_loaded"]
    assert api["loader"] == (True, True, 2)
    tags, listing = api["kept_at_return"]  # t0 left the tags before its files were deleted
    assert tags == ["t1", "t2"] and any(n.startswith(".dsrun-deleting-") for n in listing), listing
    assert api["kept"] == ["latest", "t1", "t2"]
    assert api["kept_t2"] == ["index.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    for kind, lr in (("warmup", None), ("steplr", [0.00125, 0.00125])):
        same_lr, same_state, same_loss, lrs = api[f"sched_{kind}"]
        assert same_lr and same_state and same_loss, kind
        assert lr is None or lrs == lr  # 3 steps of StepLR(gamma=0.5) from 1e-2
    assert "LR scheduler's state_dict is not JSON-serialisable (object)" in api["scheduler_error"]
    assert api["latest_after_error"] == "global_step1"


def test_cli_inspect_verify_export(saved, tmp_path):
    import shutil

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dsrun.runtime.checkpoint.cli import main
    root, out = saved
    runner = CliRunner()
    crash = tmp_path / "crash"  # with a tag a killed save left: a shard, no index
    shutil.copytree(os.path.join(root, "crash"), crash)
    (crash / "half").mkdir()
    shutil.copy(crash / "good" / "rank00000-of-00002.safetensors", crash / "half")
    res = runner.invoke(main, ["inspect", str(crash)])
    assert res.exit_code == 0, res.output
    assert "good" in res.output and "half" in res.output
    res = runner.invoke(main, ["verify", os.path.join(root, "s2_fp32")])
    assert res.exit_code == 0 and "2 files OK" in res.output, res.output
    copy = tmp_path / "s2"
    shutil.copytree(os.path.join(root, "s2_fp32"), copy)
    shard = copy / "global_step2" / "rank00000-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    res = runner.invoke(main, ["verify", str(copy)])
    assert res.exit_code == 1 and "rank00000-of-00002.safetensors is corrupted" in res.output
    ref = out["s3_bf16"]["ref"][0]
    for size, dtype in (("5GB", "fp32"), ("2KB", "bf16")):
        dest = tmp_path / f"hf_{size}"
        res = runner.invoke(main, ["export", os.path.join(root, "s3_bf16"), str(dest), "--dtype", dtype,
                                   "--max-shard-size", size])
        assert res.exit_code == 0, res.output
        if size == "5GB":
            files = ["model.safetensors"]
        else:
            with open(dest / "model.safetensors.index.json") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            assert len(files) > 1
        tensors = {k: v for f in files for k, v in load_file(str(dest / f)).items()}
        assert tensors.keys() == ref.keys()
        for n, v in tensors.items():
            want = ref[n].to(torch.bfloat16) if (dtype == "bf16" or n.startswith("h.0.")) else ref[n]
            assert torch.equal(v.float(), want.float()), n


def test_dataloader_position_round_trip():
    from torch.utils.data import TensorDataset

    from dsrun.runtime.engine.dataloader import DistributedDataLoader
    from dsrun.runtime.distributed.dist import Topology
    topo = Topology(0, 1, 0, 1, torch.device("cpu"), "gloo")
    data = TensorDataset(torch.arange(10.0))
    a = DistributedDataLoader(data, 3, topo, seed=1)
    assert a.state_dict() == {"epoch": 0, "batches": 0, "samples": 0}
    full = [b[0] for b in a]  # 4 batches (3, 3, 3, 1)
    assert len(full) == len(a) == 4 and a.state_dict() == {"epoch": 1, "batches": 0, "samples": 0}
    it = iter(a)
    first = [next(it)[0] for _ in range(2)]
    state = a.state_dict()
    assert state == {"epoch": 1, "batches": 2, "samples": 6}
    rest = [b[0] for b in it]
    b = DistributedDataLoader(data, 3, topo, seed=1)
    b.load_state_dict(state)
    assert [x[0].tolist() for x in b] == [r.tolist() for r in rest] and len(b) == 4
    assert b.state_dict() == {"epoch": 2, "batches": 0, "samples": 0}
    assert sorted(torch.cat(first + rest).tolist()) == list(range(10))


def test_dataloader_position_across_shards():
    """A position saved by 2 data shards at micro-batch 2 resumes at the
    next sample of the epoch's order with 1 shard at micro-batch 3 and with
    3 shards at micro-batch 2; a sample count that is no whole global
    micro-batch of the loader is refused by name."""
    from dsrun.runtime.distributed.dist import Topology
    from dsrun.runtime.engine.dataloader import DistributedDataLoader

    def loader(rank, shards, micro):
        return DistributedDataLoader(list(range(24)), micro, Topology(rank, shards, rank, shards,
                                                                      torch.device("cpu"), "gloo"), seed=3)

    order = [int(x) for b in loader(0, 1, 1) for x in b]
    taken, states = [], []
    for rank in range(2):
        saved = loader(rank, 2, 2)
        it = iter(saved)
        taken += [int(x) for _ in range(3) for x in next(it)]
        states.append(saved.state_dict())
    assert states[0] == states[1] == {"epoch": 0, "batches": 3, "samples": 12}
    assert sorted(taken) == sorted(order[:12])
    one = loader(0, 1, 3)
    one.load_state_dict(states[0])
    assert one.state_dict() == {"epoch": 0, "batches": 4, "samples": 12}
    assert [int(x) for b in one for x in b] == order[12:]
    rest = []
    for rank in range(3):
        three = loader(rank, 3, 2)
        three.load_state_dict(states[0])
        rest += [int(x) for b in three for x in b]
    assert sorted(rest) == sorted(order[12:])
    with pytest.raises(ValueError, match="sample 12 of its epoch: not a multiple of micro-batch size 5 x 1"):
        loader(0, 1, 5).load_state_dict(states[0])


def _killed_in_save(root, point, victim):
    import signal

    from dsrun.runtime.checkpoint import checkpointer

    rank = int(os.environ["RANK"])  # before initialize
    data = batches(rank, 2, 2, 1)
    engine = _engine(2, "fp32", {})
    _run(engine, data[:1])
    engine.save_checkpoint(root, tag="good")
    _run(engine, data[1:])
    if rank == victim:
        checkpointer.fault_hook = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == point else None
    engine.save_checkpoint(root, tag="bad")
    return "saved"


@pytest.mark.parametrize("point,victim", [("before_shard", 1), ("after_shard", 1), ("before_index", 0),
                                          ("before_latest", 0)])
def test_rank_killed_during_save(tmp_path, point, victim):
    """SIGKILL at each point of the commit protocol: `latest` and the previous
    tag survive, and no file under a final name is half-written."""
    from safetensors import safe_open

    from dsrun.runtime.checkpoint import resolve_tag
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tests.dist_helpers import RankFailed
    root = str(tmp_path)
    with pytest.raises(RankFailed):  # the victim died, or the survivor noticed it
        run_ranks(_killed_in_save, 2, root, point, victim, timeout=120)
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "good"
    tag, skipped = resolve_tag(root, None)
    assert tag == "good" and set(skipped) <= {"bad"}
    assert get_fp32_state_dict_from_zero_checkpoint(root).keys()  # checksums verified on the way
    bad = os.path.join(root, "bad")
    for name in os.listdir(bad) if os.path.isdir(bad) else ():
        if name.startswith("rank"):  # a final name: complete
            with safe_open(os.path.join(bad, name), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        elif name == "index.json":  # only when killed before `latest`
            assert point == "before_latest"
            with open(os.path.join(bad, name)) as f:
                json.load(f)


def _async_rank(root):
    from dsrun.runtime.checkpoint import CheckpointError, checkpointer

    rank = int(os.environ["RANK"])  # before initialize
    data = batches(rank, 4, 2, 1)
    out = {}
    engine = _engine(3, "bf16", {"freeze": True})
    engine.config.checkpoint.async_save = True
    _run(engine, data[:2])
    engine.save_checkpoint(os.path.join(root, "async"))
    ref = _full_state(engine)  # the state at the save...
    rest = _run(engine, data[2:])  # ... which training changes while the thread writes
    engine.wait_checkpoint()
    resumed = _engine(3, "bf16", {"freeze": True}, seed=4)
    resumed.load_checkpoint(os.path.join(root, "async"))
    got = _full_state(resumed)
    out["state_equal"] = all(torch.equal(ref[i][k], got[i][k]) for i in (0, 1) for k in ref[i])
    out["losses"] = (_run(resumed, data[2:]), rest)
    # A failure in the background thread surfaces at the next call, on every rank.
    def fail(point):
        if point == "after_shard" and rank == 1:
            raise OSError(28, "No space left on device")
    checkpointer.fault_hook = fail
    engine.save_checkpoint(os.path.join(root, "async"), tag="full")
    try:
        engine.save_checkpoint(os.path.join(root, "async"), tag="next")
        out["error"] = "no error"
    except (CheckpointError, OSError) as e:
        out["error"] = str(e)
    finally:
        checkpointer.fault_hook = None
    engine.wait_checkpoint()  # nothing pending any more
    with open(os.path.join(root, "async", "latest")) as f:
        out["latest"] = f.read()
    # keep_last from the background thread: the pruned tag's files go in a thread of their own.
    from dsrun.runtime.checkpoint import discard
    engine.config.checkpoint.keep_last = 1
    for tag in ("k0", "k1"):
        engine.save_checkpoint(os.path.join(root, "keep"), tag=tag)
    engine.wait_checkpoint()
    discard.wait()
    out["kept"] = sorted(os.listdir(os.path.join(root, "keep")))
    return out


def test_async_save(tmp_path):
    for rank, out in enumerate(run_ranks(_async_rank, 2, str(tmp_path), timeout=180)):
        assert out["state_equal"]
        assert out["losses"][0] == out["losses"][1]
        assert "asynchronous save" in out["error"] and "full" in out["error"]
        if rank == 1:
            assert "No space left on device" in out["error"]
        assert out["latest"] == "global_step2"
        if rank == 0:  # the rank that pruned (and waited for its deletion)
            assert out["kept"] == ["k1", "latest"]
