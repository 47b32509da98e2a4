"""The GPT demo: data split and model unit tests, and real 2-rank launches.

The slow tests run examples/train_gpt.py through the `dsrun` launcher with 2
gloo ranks, shortened, and check that the validation loss drops clearly and
that ZeRO stage 3 reaches the same loss as stage 0.
"""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import yaml

from tests.examples.gpt_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

from byte_data import (  # noqa: E402
    VAL_EVERY, WindowSampler, eval_windows, load_corpus, split_files, stdlib_files, windows,
)
from gpt_model import GPT, GPTConfig  # noqa: E402


# ---- data -------------------------------------------------------------------

def test_stdlib_split_has_no_file_in_both_sets():
    files = stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    train, val = split_files(files)
    assert set(train).isdisjoint(val)
    assert set(train) | set(val) == set(files)
    assert len(val) == math.ceil(len(files) / VAL_EVERY)
    # The split depends on the set of files only, not on the order given.
    assert split_files(list(reversed(files))) == (train, val)


def test_folder_corpus_keeps_each_file_in_one_split(tmp_path):
    # Each file holds one distinct letter, so the bytes show which split took it.
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i, ch in enumerate(letters):
        (tmp_path / f"f{i:02d}.txt").write_text(ch * 300)
    (tmp_path / ".hidden").write_text("#" * 300)
    corpus = load_corpus(tmp_path, seq_len=16)
    train_chars = set(bytes(corpus.train.tolist()).decode())
    val_chars = set(bytes(corpus.val.tolist()).decode())
    assert train_chars.isdisjoint(val_chars)
    assert train_chars | val_chars == set(letters)  # hidden file skipped
    assert val_chars == {letters[i] for i in range(0, len(letters), VAL_EVERY)}


def test_single_file_splits_its_bytes(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(256)) * 10)
    corpus = load_corpus(path, seq_len=32)
    assert corpus.train.numel() + corpus.val.numel() == 2560
    assert corpus.val.numel() == 256
    assert torch.equal(torch.cat([corpus.train, corpus.val]), torch.tensor(list(path.read_bytes()), dtype=torch.uint8))


def test_bad_data_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(tmp_path / "missing", seq_len=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        load_corpus(tmp_path / "empty", seq_len=8)
    (tmp_path / "tiny.txt").write_text("short")
    with pytest.raises(ValueError, match="smaller --seq_len"):
        load_corpus(tmp_path / "tiny.txt", seq_len=8)


def test_windows_targets_are_inputs_shifted_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = windows(data, torch.tensor([0, 50, 89]), seq_len=10)
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[2], torch.arange(89, 99)) and y[2, -1] == 99  # last window ends at the last byte


def test_samplers_differ_by_seed_and_eval_set_is_fixed():
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    a = WindowSampler(data, 32, seed=1).sample(8)[0]
    assert torch.equal(a, WindowSampler(data, 32, seed=1).sample(8)[0])
    assert not torch.equal(a, WindowSampler(data, 32, seed=2).sample(8)[0])
    assert torch.equal(eval_windows(data, 8, 32, seed=0)[0], eval_windows(data, 8, 32, seed=0)[0])


def test_yaml_config_is_a_twin_of_the_json_config():
    configs = EXAMPLES / "configs"
    assert yaml.safe_load((configs / "gpt_demo.yaml").read_text()) == json.loads((configs / "gpt_demo.json").read_text())


# ---- model ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_demo.json", "gpt_demo.yaml"])
def test_the_schedule_and_the_progress_total_follow_steps(name):
    """--steps 3 with a config made for 400 steps: the LR schedule is fitted
    to 3 steps, and the progress records the launcher prints from say 3."""
    from train_gpt import parse_args, run_config

    from dsrun.launcher.progress import format_record
    from dsrun.runtime.config import load_config
    from dsrun.runtime.engine.telemetry import _scheduler_total
    config = run_config(parse_args(["--config", str(EXAMPLES / "configs" / name), "--steps", "3"]))
    assert config["scheduler"]["params"]["total_num_steps"] == 3
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1  # 40 of 400 in the file: scaled, >= 1
    total = _scheduler_total(load_config(config, world_size=1))
    assert format_record({"step": 1, "total": total}) == "step 1/3 (33%)"
    assert run_config(parse_args([])) is None  # no --config: nothing to fit


def test_model_shapes_tied_head_and_param_groups():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    assert model.head.weight is model.tok_emb.weight
    loss = model(idx, torch.randint(0, 256, (3, 16)))
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.2  # near-uniform at init
    groups = model.param_groups()
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each tensor exactly once
    assert groups[1]["weight_decay"] == 0.0 and all(p.dim() < 2 for p in groups[1]["params"])
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(n_embd=30, n_head=4)


def test_model_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=12, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(0, 256, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


# ---- end to end -------------------------------------------------------------

# Enough for the loss to fall by more than 1 nat/byte (4 warm-up steps); the
# stage-0 run is also test_train_gpt_pipe.py's data-parallel reference.
STEPS = 20


@pytest.mark.slow
def test_demo_trains_through_the_launcher(gpt_run):
    """2 ranks via `dsrun`: the validation loss must fall by more than 1 nat/byte."""
    before, after, drop = gpt_run(2, STEPS)
    assert 5.0 < before < 5.7  # an untrained byte model scores about ln 256 = 5.55
    assert before - after > 1.0, (before, after)
    assert abs(drop - (before - after)) < 1e-3


@pytest.mark.slow
def test_demo_zero3_config_matches_stage0(gpt_run):
    """gpt_zero3.json partitions every parameter; in fp32 it must train to the same loss.

    With 2 ranks a sum of two gradients does not depend on the reduction's
    order, so stage 3 and stage 0 agree to the printed 4 decimals.
    """
    before, after, _ = gpt_run(2, STEPS, config_name="gpt_zero3.json")
    assert (before, after) == pytest.approx(gpt_run(2, STEPS)[:2], abs=2e-4)
