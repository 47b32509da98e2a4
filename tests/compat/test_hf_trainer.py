"""Hugging Face Trainer on dsrun through the `deepspeed` alias distribution
(extras/deepspeed-alias): ZeRO-3 bf16 with an "auto" config, HF's zero.Init
weight init, loss going down, save and an exact resume, on 2 ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def alias_dir(tmp_path_factory) -> Path:
    """The alias distribution installed into a private directory (not the venv)."""
    target = tmp_path_factory.mktemp("deepspeed_alias")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "extras" / "deepspeed-alias")], check=True)
    return target


def train(alias_dir: Path, out: Path, *args: str) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(alias_dir), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    run = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--num_procs", "2",
                          "--master_port", str(free_port()), str(SCRIPT),
                          "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    found = {}
    for line in run.stdout.splitlines():
        _, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            record = json.loads(rest[len("RESULT "):])
            found[record["rank"]] = record
    assert sorted(found) == [0, 1], run.stdout[-3000:]
    return found


def test_alias_metadata_and_modules(alias_dir):
    code = ("import importlib.metadata as md, deepspeed, dsrun, deepspeed.comm, dsrun.comm;"
            "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus;"
            "print(md.version('deepspeed'), deepspeed is dsrun, deepspeed.comm is dsrun.comm)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(alias_dir), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.16.5+dsrun.0.1.0", "True", "True"]


def test_trainer_zero3_bf16_auto_config_trains_saves_and_resumes(alias_dir, tmp_path):
    straight = train(alias_dir, tmp_path / "straight", "--steps", "16")
    first = train(alias_dir, tmp_path / "split", "--steps", "12")
    resumed = train(alias_dir, tmp_path / "split", "--steps", "16", "--resume")
    for rank in (0, 1):
        r = first[rank]
        assert r["engine"] == "Engine" and r["stage"] == 3 and r["bf16"] and r["train_batch_size"] == 8
        assert r["partitioned_at_build"]  # from_config ran under HF's zero.Init
        assert 0.018 < r["wte_std"] < 0.022  # HF's init (std 0.02) reached the partitioned weights
        assert r["losses"][-1] < r["losses"][0] - 0.4  # it learned
        assert resumed[rank]["steps"] == 16
    # the resumed run continues where the checkpoint left off, step for step
    assert resumed[0]["losses"][12:] == pytest.approx(straight[0]["losses"][12:], rel=1e-6)
    assert (tmp_path / "split" / "checkpoint-12" / "latest").read_text().strip() == "global_step12"
    assert (tmp_path / "split" / "final" / "model.safetensors").stat().st_size > 0
