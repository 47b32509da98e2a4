"""Hostile or careless config input gets one precise ConfigError (issue 11, items 13-14)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsrun.runtime.config import ConfigError, load_config
from tests.dist_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_batch_size": 2}


def _problems(source) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(source, world_size=1)
    return info.value.problems


def test_yaml_alias_bomb_is_rejected_before_expanding(tmp_path):
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcdef", "bcdefg"):
        # 10**7 strings once expanded: 7 s here before aliases were refused; each
        # further line is 10x the time and memory (45 s and 3.2 GB was reported)
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines + ["train_batch_size: 2"]) + "\n")
    start = time.monotonic()
    problems = _problems(path)
    assert time.monotonic() - start < 5
    assert problems == ["not valid YAML at line 2, column 8: YAML alias *a is not allowed in a dsrun config; "
                        "write the value out where it is used"]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_nested_100k_deep_is_a_config_error(tmp_path, suffix):
    path = tmp_path / f"deep{suffix}"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text('{"train_batch_size": 2, "x": ' + deep + "}" if suffix == ".json"
                    else f"train_batch_size: 2\nx: {deep}\n")
    assert _problems(path) == ["nested more than a few hundred levels deep; a ds_config has at most 3 "
                               "levels of sections"]


def test_deeply_nested_dict_is_a_config_error():
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["x"] = {}
        node = node["x"]
    assert "nested more than a few hundred levels deep" in _problems({**BASE, "x": deep})[0]


@pytest.mark.parametrize("text, message", [
    ("", "the config file is empty"),
    ("  \n", "the config file is empty"),
    ("# only a comment\n", "the config file has no keys (only comments or an empty document)"),
])
def test_empty_yaml_file(tmp_path, text, message):
    path = tmp_path / "ds.yaml"
    path.write_text(text)
    assert _problems(path)[0].startswith(message)


def test_invalid_utf8(tmp_path):
    path = tmp_path / "ds.json"
    data = b'{"train_batch_size": 2,\n "x": "\xff\xfe"}'
    path.write_bytes(data)
    assert _problems(path) == [f"not valid UTF-8: byte 0xff at line 2 (byte offset {data.index(0xff)}); "
                               "save the file as UTF-8"]


@pytest.mark.parametrize("section, value", [("bf16", "yes"), ("bf16", "true"), ("bf16", 1), ("fp16", "no")])
def test_words_and_numbers_are_not_booleans(section, value):
    assert _problems({**BASE, section: {"enabled": value}}) == [
        f"{section}.enabled: expected true or false, got {value!r}"]


def test_numbers_in_strings_are_still_numbers():
    assert load_config({**BASE, "zero_optimization": {"stage": "2"}}, world_size=1).zero_optimization.stage == 2


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size"])
def test_bucket_sizes_must_be_positive(key):
    assert _problems({**BASE, "zero_optimization": {key: 0}}) == [
        f"zero_optimization.{key}: expected a positive integer, got 0"]


@pytest.mark.parametrize("power", [33, 200, 2000, -1])
def test_initial_scale_power_is_bounded(power):
    assert _problems({**BASE, "fp16": {"enabled": True, "initial_scale_power": power}}) == [
        f"fp16.initial_scale_power: expected an integer 0-32, got {power}"]


def test_optimizer_params_are_checked_with_the_other_problems():
    problems = _problems({**BASE, "zero_optimization": {"reduce_bucket_size": 0},
                          "optimizer": {"type": "AdamW", "params": {"lr": -1, "betas": [1.5, 0.9],
                                                                    "weight_decay": "a lot"}}})
    assert "zero_optimization.reduce_bucket_size: expected a positive integer, got 0" in problems
    optimizer = next(p for p in problems if p.startswith("optimizer."))
    assert optimizer.startswith("optimizer.params.lr: expected a finite number >= 0, got -1")
    assert "optimizer.params.weight_decay: expected a finite number >= 0, got 'a lot'" in optimizer
    assert "optimizer.params.betas: expected two numbers in [0, 1) such as [0.9, 0.999], got [1.5, 0.9]" \
        in optimizer
    assert _problems({**BASE, "optimizer": {"type": "SGD", "params": {"lr": "fast"}}}) == [
        "optimizer.params.lr: expected a finite number >= 0, got 'fast'"]


_TRAIN = """\
import argparse, torch, dsrun
args = dsrun.add_config_arguments(argparse.ArgumentParser()).parse_args()
dsrun.initialize(args=args, model=torch.nn.Linear(2, 2))
print("initialized")
"""


def test_bad_config_under_two_ranks_prints_one_message_and_exit_code_78(tmp_path):
    (tmp_path / "train.py").write_text(_TRAIN)
    (tmp_path / "bad.json").write_text('{"train_batch_size": 4, "bf16": {"enabled": "yes"}}')
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2", "--no_local_rank",
            "--master_port", str(free_port()), "train.py", "--config", "bad.json"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 78, out
    assert "Traceback" not in out and "initialized" not in out
    message = "bf16.enabled: expected true or false, got 'yes'"
    live = [line for line in out.splitlines() if line.startswith("[rank") and message in line]
    assert len(live) == 1 and live[0].startswith("[rank 0]"), out  # rank 1 stays quiet
    assert "invalid dsrun config (message below)" in out
    assert out.count(message) == 2, out  # the live line and the summary's copy
