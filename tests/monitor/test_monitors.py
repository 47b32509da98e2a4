"""The monitors write DeepSpeed's events for a real run: CSV files, TensorBoard event files,
an offline W&B run (WANDB_MODE=offline: nothing leaves the machine), each read back."""
from __future__ import annotations

import csv
import glob
import os
import sys

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.monitor.wandb_reader import history, run_info

VOCAB, SEQ, MICRO = 32, 6, 2


class TokenModel(torch.nn.Module):
    """Embedding + linear language model: forward(token ids (B, T) int64) -> scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.emb(x[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _vm(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def train(out_dir: str, extra: dict, steps: int, gas: int, ballast_rank: int | None = None) -> dict:
    """Train TokenModel for `steps` optimizer steps; return what the monitors should show."""
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out_dir, WANDB_SILENT="true")
    import dsrun

    torch.manual_seed(0)
    model = TokenModel()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(engine.global_rank)
    losses, norms, rss_before_last = [], [], 0
    ballast = None
    for step in range(steps):
        if step == steps - 1:
            if engine.global_rank == ballast_rank:
                ballast = torch.ones(40 * 2**20 // 4)  # 40 MiB more on this rank only, touched
            rss_before_last = _vm("VmRSS")
        micro = []
        for _ in range(gas):
            loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen))
            engine.backward(loss)
            engine.step()
            micro.append(loss.item())
        losses.append(sum(micro) / gas)
        norms.append(engine.get_global_grad_norm())
    del ballast
    monitors = len(engine.monitor.monitors)  # before close(), which lets go of them
    engine.monitor.close()
    return {"losses": losses, "norms": norms, "monitors": monitors,
            "params": sum(p.numel() for p in model.parameters()), "rss_before_last": rss_before_last,
            "hwm_after": _vm("VmHWM"), "samples_per_step": engine.train_batch_size()}


def read_csv(run_dir, name: str) -> tuple[list[int], list[float]]:
    path = os.path.join(run_dir, name.replace("/", "_") + ".csv")
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", name.rsplit("/", 1)[-1]]
    return [int(r[0]) for r in rows[1:]], [float(r[1]) for r in rows[1:]]


def test_csv_tensorboard_and_wandb_write_the_step_events(tmp_path):
    out = str(tmp_path)
    extra = {"csv_monitor": {"enabled": True, "output_path": out, "job_name": "csvrun"},
             "tensorboard": {"enabled": True, "output_path": out, "job_name": "tbrun"},
             "wandb": {"enabled": True, "project": "dsrun-test", "group": "g1"}}
    steps, gas = 3, 2
    rank0, rank1 = run_ranks(train, 2, out, extra, steps, gas, 1, timeout=240)
    assert (rank0["monitors"], rank1["monitors"]) == (3, 0)  # rank 0 only
    xs = [rank0["samples_per_step"] * (i + 1) for i in range(steps)]  # DeepSpeed's x axis: samples
    assert xs == [8, 16, 24]

    csv_dir = tmp_path / "csvrun"
    x, loss = read_csv(csv_dir, "Train/Samples/train_loss")
    assert x == xs and loss == pytest.approx(rank0["losses"], rel=1e-6)  # rank 0's mean over micro-batches
    assert read_csv(csv_dir, "Train/Samples/lr")[1] == [0.1] * steps
    assert read_csv(csv_dir, "Train/Samples/grad_norm")[1] == pytest.approx(rank0["norms"], rel=1e-6)
    assert read_csv(csv_dir, "Train/Samples/skipped_steps")[1] == [0] * steps
    samples_s = read_csv(csv_dir, "Train/Samples/samples_per_sec")[1]
    tokens_s = read_csv(csv_dir, "Train/Samples/tokens_per_sec")[1]
    step_ms = read_csv(csv_dir, "Train/Samples/step_time_ms")[1]
    assert all(s > 0 for s in samples_s)
    assert [t / s for t, s in zip(tokens_s, samples_s)] == pytest.approx([SEQ] * steps)  # tokens per sample
    assert [8 / (ms / 1e3) for ms in step_ms] == pytest.approx(samples_s)
    # stage 0 in fp32: one all-reduce of every gradient element per step, 4 bytes each
    assert read_csv(csv_dir, "Train/Samples/comm_bytes")[1] == [rank0["params"] * 4] * steps
    assert all(t >= 0 for t in read_csv(csv_dir, "Train/Samples/comm_time_ms")[1])
    # the highest of both ranks: rank 1 holds 40 MiB more in the last step
    peak = read_csv(csv_dir, "Train/Samples/peak_memory_bytes")[1][-1]
    assert rank1["rss_before_last"] > rank0["hwm_after"]
    slack = 2**20  # the kernel's RSS counters lag by up to 64 pages per thread (split RSS counting)
    assert rank1["rss_before_last"] - slack <= peak <= max(rank0["hwm_after"], rank1["hwm_after"]) + slack
    assert (csv_dir / "deepspeed_config.csv").exists()
    assert not os.path.exists(os.path.join(csv_dir, "Train_Samples_loss_scale.csv"))  # fp16 only

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tbrun"))
    acc.Reload()
    scalars = acc.Scalars("Train/Samples/train_loss")
    assert [s.step for s in scalars] == xs
    assert [s.value for s in scalars] == pytest.approx(rank0["losses"], rel=1e-6)
    assert {"Train/Samples/lr", "Train/Samples/grad_norm", "Train/Samples/peak_memory_bytes"} <= set(
        acc.Tags()["scalars"])

    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    info = run_info(run_file)
    assert (info.project, info.run_group) == ("dsrun-test", "g1")
    rows = [r for r in history(run_file) if "Train/Samples/train_loss" in r]
    assert [r["_step"] for r in rows] == xs
    assert [r["Train/Samples/train_loss"] for r in rows] == pytest.approx(rank0["losses"], rel=1e-6)
    assert [r["Train/Samples/lr"] for r in rows] == [0.1] * steps


def write_custom(out_dir: str) -> list[str]:
    import dsrun

    engine, *_ = dsrun.initialize(model=TokenModel(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "api"}})
    engine.monitor.write_events([("Eval/accuracy", 0.5, 10), ("Eval/accuracy", 0.75, 20)])
    return sorted(os.listdir(os.path.join(out_dir, "api")))


def test_write_events_is_deepspeeds_api(tmp_path):
    (files,) = run_ranks(write_custom, 1, str(tmp_path), timeout=120)
    assert "Eval_accuracy.csv" in files
    assert read_csv(tmp_path / "api", "Eval/accuracy") == ([10, 20], [0.5, 0.75])


def destroyed(out_dir: str) -> dict:
    import dsrun

    engine, *_ = dsrun.initialize(model=TokenModel(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"}})
    engine.backward(engine(torch.randint(0, VOCAB, (1, SEQ))))
    engine.step()
    writer = engine.monitor.monitors[0].summary_writer
    before = writer.all_writers is not None
    engine.destroy()
    engine.monitor.write_events([("Eval/accuracy", 0.5, 10)])  # after close: nothing, no error
    return {"before": before, "closed": writer.all_writers is None, "monitors": len(engine.monitor.monitors)}


def test_destroy_closes_the_monitors(tmp_path):
    """engine.destroy() closes the TensorBoard writer (SummaryWriter.close
    drops its file writers) and leaves no monitor to write to."""
    (out,) = run_ranks(destroyed, 1, str(tmp_path), timeout=180)
    assert out["before"] and out["closed"] and out["monitors"] == 0


def fp16_loss_scale(out_dir: str) -> list[float]:
    import dsrun

    engine, *_ = dsrun.initialize(model=TokenModel(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 1},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "fp16"}})
    for _ in range(2):
        engine.backward(engine(torch.randint(0, VOCAB, (2, SEQ))))
        engine.step()
    return [engine.strategy.loss_scale()]


def test_fp16_runs_write_the_loss_scale(tmp_path):
    (scale,) = run_ranks(fp16_loss_scale, 1, str(tmp_path), timeout=120)
    assert read_csv(tmp_path / "fp16", "Train/Samples/loss_scale")[1] == [256.0, scale[0]]


def test_a_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    from dsrun.runtime.monitor import MonitorUnavailableError
    from dsrun.runtime.monitor.tensorboard import TensorBoardMonitor
    from dsrun.runtime.monitor.wandb_monitor import WandbMonitor

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MonitorUnavailableError, match="pip install tensorboard"):
        TensorBoardMonitor(str(tmp_path), "x")
    with pytest.raises(MonitorUnavailableError, match="pip install wandb"):
        WandbMonitor("p", None, None)


def test_deepspeeds_module_paths():
    from dsrun.monitor.monitor import MonitorMaster
    from dsrun.runtime.config import load_config
    from dsrun.runtime.monitor import MonitorMaster as runtime_master

    assert MonitorMaster is runtime_master
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "csv_monitor": {"enabled": True}}, world_size=1)
    assert MonitorMaster(cfg, rank=1).monitors == [] and MonitorMaster(cfg, rank=1).enabled
