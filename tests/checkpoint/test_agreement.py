"""Ranks that pass different directories or tags to save_checkpoint /
load_checkpoint (issue 30): rank 0's are used on every rank with one warning
on rank 0, or, under strict checking, every rank raises before any file is
touched. See [Note: agreed location] in dsrun/runtime/checkpoint/checkpointer.py.
"""
import logging
import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.zero.models import TinyGPT, base_config, batches, mean_loss_step, param_groups


def _engine(seed=0, checkpoint=None):
    import dsrun

    torch.manual_seed(seed)
    model = TinyGPT()
    cfg = base_config(1)
    if checkpoint is not None:
        cfg["checkpoint"] = checkpoint
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
                                  config=cfg)
    return engine


def _train(engine, data):
    """The mean loss over ranks of each step."""
    return [mean_loss_step(engine, idx, tgt) for idx, tgt in data]


def _params(engine):
    """Every parameter's full value (stage 1: each rank holds them whole)."""
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


class _Warnings(logging.Handler):
    """The warnings dsrun's checkpointer logs on this rank."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        logging.getLogger("dsrun.checkpoint").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def take(self):
        out, self.messages = self.messages, []
        return out


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root)
                  for n in dirs + files)


def _different_arguments(root):
    from dsrun.runtime.checkpoint import CheckpointError

    rank = int(os.environ["RANK"])
    data = batches(rank, 3, 2, 1)
    warnings = _Warnings()
    out = {}
    engine = _engine()
    _train(engine, data[:2])
    engine.save_checkpoint(os.path.join(root, f"dir{rank}"), client_state={"from": rank})
    out["save_dir_warnings"] = warnings.take()
    out["saved"] = _params(engine)
    out["continued"] = _train(engine, data[2:])
    other = _engine(seed=5)
    path, client = other.load_checkpoint(os.path.join(root, "dir0" if rank == 0 else f"nothing{rank}"))
    out["load_dir_warnings"] = warnings.take()
    same = all(torch.equal(v, out["saved"][n]) for n, v in _params(other).items())
    out["loaded"] = (path, client, same, other.global_steps)
    out["resumed"] = _train(other, data[2:])

    engine.save_checkpoint(os.path.join(root, "tags"), tag=f"t{rank}")
    out["tag_warnings"] = warnings.take()
    path, _ = other.load_checkpoint(os.path.join(root, "tags"), tag=f"t{rank}")
    out["load_tag"] = (path, warnings.take(), other.global_steps)
    engine.config.checkpoint.tag_validation = "Ignore"
    engine.save_checkpoint(os.path.join(root, "tags"), tag=f"quiet{rank}")
    out["ignore_warnings"] = warnings.take()
    engine.config.checkpoint.tag_validation = "Fail"
    try:
        engine.save_checkpoint(os.path.join(root, "tags"), tag=f"fail{rank}")
        out["fail"] = "no error"
    except CheckpointError as e:
        out["fail"] = str(e)
    engine.config.checkpoint.tag_validation = "Warn"
    engine.save_checkpoint(os.path.join(root, "same"), tag="t")  # nothing differs: no warning
    out["same_warnings"] = warnings.take()
    out["listing"] = _listing(root)
    return out


@pytest.fixture(scope="module")
def different(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("agree"))
    return root, run_ranks(_different_arguments, 2, root, timeout=240)


def test_different_save_dir_saves_in_rank0s(different):
    root, outs = different
    listing = outs[0]["listing"]
    assert "dir0/global_step2/index.json" in listing
    assert {"dir0/global_step2/rank00000-of-00002.safetensors",
            "dir0/global_step2/rank00001-of-00002.safetensors"} <= set(listing)
    assert not [n for n in listing if n.startswith(("dir1", "nothing1"))], listing
    warned = outs[0]["save_dir_warnings"]
    assert warned == [f"save_checkpoint: the ranks passed different arguments: rank 1 passed save_dir "
                      f"'{os.path.join(root, 'dir1')}', rank 0's '{os.path.join(root, 'dir0')}' is used"]
    assert outs[1]["save_dir_warnings"] == []  # printed once, by rank 0


def test_different_load_dir_loads_rank0s_on_two_ranks(different):
    root, outs = different
    for rank, out in enumerate(outs):
        path, client, same_params, steps = out["loaded"]
        assert path == os.path.join(root, "dir0", "global_step2")
        assert client == {"from": 0}  # client_state is rank 0's
        assert same_params and steps == 2
        assert out["resumed"] == out["continued"]
    assert outs[0]["load_dir_warnings"] == [
        f"load_checkpoint: the ranks passed different arguments: rank 1 passed load_dir "
        f"'{os.path.join(root, 'nothing1')}', rank 0's '{os.path.join(root, 'dir0')}' is used"]
    assert outs[1]["load_dir_warnings"] == []


def _load_alone(root):
    engine = _engine(seed=7)
    path, client = engine.load_checkpoint(os.path.join(root, "dir0"))
    return path, client, _params(engine)


def test_different_save_dir_loads_on_one_rank(different):
    root, outs = different
    path, client, params = run_ranks(_load_alone, 1, root, timeout=120)[0]
    assert path == os.path.join(root, "dir0", "global_step2") and client == {"from": 0}
    assert params.keys() == outs[0]["saved"].keys()
    assert all(torch.equal(params[n], outs[0]["saved"][n]) for n in params)


def test_different_tag(different):
    root, outs = different
    listing = outs[0]["listing"]
    assert "tags/t0/index.json" in listing and not any(n.startswith("tags/t1") for n in listing)
    assert outs[0]["tag_warnings"] == ["save_checkpoint: the ranks passed different arguments: "
                                       "rank 1 passed tag 't1', rank 0's 't0' is used"]
    for rank, out in enumerate(outs):
        path, warned, steps = out["load_tag"]
        assert path == os.path.join(root, "tags", "t0") and steps == 3
        assert warned == ([] if rank else ["load_checkpoint: the ranks passed different arguments: "
                                           "rank 1 passed tag 't1', rank 0's 't0' is used"])
    assert outs[1]["tag_warnings"] == []


def test_tag_validation(different):
    """DeepSpeed's checkpoint.tag_validation: Ignore uses rank 0's tag without
    a word, Fail raises on every rank before writing."""
    _, outs = different
    listing = outs[0]["listing"]
    assert "tags/quiet0/index.json" in listing and not any(n.startswith("tags/quiet1") for n in listing)
    assert outs[0]["ignore_warnings"] == [] and outs[1]["ignore_warnings"] == []
    for out in outs:
        assert out["fail"].startswith("save_checkpoint: the ranks passed different arguments: rank 1 passed "
                                      "tag 'fail1', rank 0's 'fail0'. Nothing was read or written"), out["fail"]
    assert not any(n.startswith("tags/fail") for n in listing)
    assert outs[0]["same_warnings"] == [] and "same/t/index.json" in listing


def _strict(root):
    from dsrun.runtime.checkpoint import CheckpointError
    from dsrun.runtime.config import STRICT_ENV

    rank = int(os.environ["RANK"])
    warnings = _Warnings()
    out = {}
    engine = _engine(checkpoint={"strict_paths": True})
    _train(engine, batches(rank, 1, 2, 1))
    for how in ("config", "env"):
        if how == "env":
            engine.config.checkpoint.strict_paths = False
            os.environ[STRICT_ENV] = "1"
        for call in ("save", "load"):
            try:
                if call == "save":
                    engine.save_checkpoint(os.path.join(root, f"{how}{rank}"), client_state={"x": 1})
                else:
                    engine.load_checkpoint(os.path.join(root, f"{how}{rank}"))
                out[how, call] = "no error"
            except CheckpointError as e:
                out[how, call] = str(e)
    out["warnings"] = warnings.take()
    out["listing"] = _listing(root)
    return out


def test_strict_raises_on_every_rank_and_writes_nothing(tmp_path):
    root = str(tmp_path)
    outs = run_ranks(_strict, 2, root, timeout=180)
    for out in outs:
        for how in ("config", "env"):
            for call, arg in (("save", "save_dir"), ("load", "load_dir")):
                assert out[how, call] == (
                    f"{call}_checkpoint: the ranks passed different arguments: rank 1 passed {arg} "
                    f"'{os.path.join(root, how + '1')}', rank 0's '{os.path.join(root, how + '0')}'. Nothing "
                    f"was read or written; every rank must pass the same {arg} and tag (without "
                    "DSRUN_STRICT_CONFIG=1, checkpoint.strict_paths or checkpoint.tag_validation \"Fail\", "
                    "rank 0's are used)")
        assert out["warnings"] == []
    assert outs[0]["listing"] == [] and os.listdir(root) == []


# ---- a DeepSpeedExamples-style script --------------------------------------------------------
# bing_bert's deepspeed_train.py names its output after the job and saves with
# checkpoint_model(PATH, ckpt_id, model, epoch, last_global_step, ...): here
# the job name carries the time to the second, computed on each rank, and a
# fake clock puts rank 1 one second behind rank 0 (as in issue 30).
FAKE_NOW = 1795687717.0  # 2026-11-26 10:08:37 UTC


def _fake_clock(seconds_behind):
    import time

    real = time.strftime

    def strftime(fmt, t=None):
        return real(fmt, time.gmtime(FAKE_NOW - seconds_behind) if t is None else t)
    time.strftime = strftime
    return real


def _bert_style_run(output_dir, data, load_training_checkpoint=None, load_checkpoint_id=None):
    """One run of the script: returns (its checkpoint path, ckpt id, losses, the client state it resumed from)."""
    import time

    job_name = "bert_pretrain." + time.strftime("%Y.%m.%d.%H.%M.%S")
    saved_model_path = os.path.join(output_dir, "saved_models", job_name)
    model = _engine(seed=11)
    start, resumed_from = 0, None
    if load_training_checkpoint is not None:
        _, checkpoint_state_dict = model.load_checkpoint(load_training_checkpoint, load_checkpoint_id)
        start, resumed_from = checkpoint_state_dict["last_global_step"], checkpoint_state_dict
    losses = _train(model, data[start:start + 2])
    ckpt_id = f"epoch{1 if start == 0 else 2}_step{model.global_steps}"
    model.save_checkpoint(saved_model_path, ckpt_id, {"epoch": 1, "last_global_step": model.global_steps,
                                                      "last_global_data_samples": model.global_samples})
    return saved_model_path, ckpt_id, losses, resumed_from


def _bert_style(output_dir):
    import time

    rank = int(os.environ["RANK"])
    data = batches(rank, 4, 2, 1)
    real = _fake_clock(seconds_behind=rank)
    try:
        first = _bert_style_run(output_dir, data)
        # The resumed run is started later: its own name is another second,
        # and it is told where the first one saved (rank 0's path, from the log).
        _fake_clock(seconds_behind=rank - 60)
        path = os.path.join(output_dir, "saved_models", "bert_pretrain.2026.11.26.10.08.37")
        second = _bert_style_run(output_dir, data, path, first[1])
    finally:
        time.strftime = real
    reference = _train(_engine(seed=11), data)  # the same 4 steps without a restart
    return first, second, reference, _listing(output_dir)


def test_bert_style_script_with_clocks_a_second_apart(tmp_path):
    outs = run_ranks(_bert_style, 2, str(tmp_path), timeout=240)
    (path0, ckpt0, losses0, _), (path0b, _, losses0b, resumed0), reference, listing = outs[0]
    (path1, _, _, _), (_, _, _, resumed1), _, _ = outs[1]
    assert path0.endswith("bert_pretrain.2026.11.26.10.08.37") and path1.endswith("bert_pretrain.2026.11.26.10.08.36")
    assert ckpt0 == "epoch1_step2"
    assert f"saved_models/bert_pretrain.2026.11.26.10.08.37/{ckpt0}/index.json" in listing
    assert "saved_models/bert_pretrain.2026.11.26.10.09.37/epoch2_step4/index.json" in listing
    assert not any("10.08.36" in n or "10.09.36" in n for n in listing), listing
    assert resumed0 == resumed1 == {"epoch": 1, "last_global_step": 2, "last_global_data_samples": 8}
    assert losses0 + losses0b == reference
