"""Checkpoints across the whole mesh (issue 35 item 6): a checkpoint saved at
pipe x tensor x sequence (x data) loads in one process, into the plain
model, with weights and Adam moments bit for bit and the engine's data
loader at the same global sample.

The model is test_sequence_3d's tiny Llama-like LM (AutoTP shards its
q/k/v/o and MLP projections, Ulysses splits the local heads over the
sequence ranks), trained 2 steps at ZeRO-1 and saved. At save time every
rank's slices (value, exp_avg, exp_avg_sq of each parameter) are put
together into the full tensors; after the load in one process the plain
`nn.Sequential` holds exactly those. Every stored tensor is covered once
(no slice written twice by the sequence ranks, none missing), and
`dsrun-ckpt export` gives the plain model's state dict, bit for bit.
The engine's loader (`initialize(training_data=...)`) is advanced 4
micro-batches before the save; the loaded one continues at the next sample
of the same shuffled epoch. 4 ranks: pipe 2 x sequence 2 (ZeRO 0, 1, 2)
and tensor 2 x sequence 2 (ZeRO 1, 2, 3); 8 ranks (slow): pipe 2 x tensor 2 x sequence 2, and tensor 2 x
sequence 2 x data 2.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_sequence_3d import LAYERS, MICRO, SAMPLES, STEPS, _batches, token_mean_loss
from tests.parallel.test_tp_checkpoint import _check_slices, _full, _slices

DATASET = 32      # samples of the engine's loader (integers: the sample is its index)
ADVANCED = 4      # micro-batches each rank takes from it before the save


def _config(pipe: int, tensor: int, sequence: int, stage: int) -> dict:
    return {"train_batch_size": SAMPLES, "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 1000, "pipeline": {"stages": pipe}, "tensor_parallel": {"autotp_size": tensor},
            "sequence_parallel_size": sequence}


def _engine(pipe: int, tensor: int, sequence: int, stage: int = 1):
    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    cfg = _config(pipe, tensor, sequence, stage)
    dsrun.init_distributed(config=cfg)  # the mesh first: the attention takes its sequence group
    if pipe > 1:
        model = PipelineModule([LayerSpec(cls, seed) for cls, seed in LAYERS], num_stages=pipe,
                               loss_fn=token_mean_loss, partition_method="uniform")
    else:
        model = torch.nn.Sequential(*(cls(seed) for cls, seed in LAYERS))
    engine, *_ = dsrun.initialize(model=model, config=cfg, training_data=list(range(DATASET)))
    return engine


def _save(pipe: int, tensor: int, sequence: int, stage: int, path: str):
    """STEPS steps at the layout, the loader advanced ADVANCED micro-batches,
    save. Returns (slices at save time, the samples this rank's loader gave)."""
    from dsrun.utils import groups
    engine = _engine(pipe, tensor, sequence, stage)
    batches = iter(_batches(sequence, groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()))
    for _ in range(2):
        if pipe > 1:
            engine.train_batch(batches)
        else:
            for _ in range(engine.gradient_accumulation_steps()):
                ids, labels = next(batches)
                engine.backward(token_mean_loss(engine(ids), labels))
                engine.step()
    loader = iter(engine.training_dataloader)
    given = [int(s) for _ in range(ADVANCED) for s in next(loader)]
    engine.save_checkpoint(path, tag="t")
    held = _slices(engine)
    engine.destroy()
    return held, given


def _load_plain(path: str, export_dir: str | None):
    """Load into the plain model on every rank (data parallelism only,
    ZeRO-1). Returns (slices, the module's state dict and the export of the
    checkpoint (when export_dir), the loader's state and this rank's
    remaining samples of the epoch)."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dsrun.runtime.checkpoint.cli import main as ckpt_cli
    engine = _engine(1, 1, 1)
    engine.load_checkpoint(path, tag="t")
    held = _slices(engine)
    state, exported = None, None
    if export_dir is not None:
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        result = CliRunner().invoke(ckpt_cli, ["export", path, export_dir, "--dtype", "fp32"])  # dsrun-ckpt export
        assert result.exit_code == 0, result.output
        exported = load_file(os.path.join(export_dir, "model.safetensors"))
    position = engine.training_dataloader.state_dict()
    rest = [int(s) for batch in engine.training_dataloader for s in batch]
    engine.destroy()
    return held, state, exported, position, rest


def _epoch_order() -> list[int]:
    """The loader's epoch-0 order of the samples in one process."""
    import dsrun
    dsrun.init_distributed()
    from dsrun.runtime.distributed.dist import Topology
    from dsrun.runtime.engine.dataloader import DistributedDataLoader
    loader = DistributedDataLoader(list(range(DATASET)), MICRO, Topology(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    return [int(s) for batch in loader for s in batch]


def _check_stored_once(path: str) -> None:
    """Every stored module/optimizer tensor's slices cover it exactly once."""
    from dsrun.runtime.checkpoint.store import load_index
    index = load_index(os.path.join(path, "t"))
    for name, entry in index.tensors.items():
        if name.startswith(("module/", "optim/")):
            ends = sorted((s.lo, s.hi) for s in entry.slices)
            assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])), (name, ends)
            assert ends[-1][1] == torch.Size(entry.shape).numel(), (name, ends)


def _check(tmp_path, world: int, pipe: int, tensor: int, sequence: int, stage: int = 1,
           data_parallel_load: bool = False) -> None:
    """Save at the layout on `world` ranks; load in one process (and, with
    data_parallel_load, on 2 data-parallel ranks) and compare."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, world, pipe, tensor, sequence, stage, path, timeout=480)
    full = _full([held for held, _ in saved])
    _check_stored_once(path)

    held, state, exported, position, rest = run_ranks(_load_plain, 1, path, str(tmp_path / "export"),
                                                      timeout=240)[0]
    assert set(held) == set(full)  # the plain model's names are the stages' global ones
    _check_slices(full, [held])
    assert set(exported) == set(state)
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name

    order = run_ranks(_epoch_order, 1, timeout=120)[0]
    data = world // (pipe * tensor * sequence)
    taken = ADVANCED * MICRO * data  # samples of the epoch the saved job's data ranks took
    assert sorted(set().union(*(given for _, given in saved))) == sorted(order[:taken])
    assert position == {"epoch": 0, "batches": taken // MICRO, "samples": taken}
    assert rest == order[taken:]

    if data_parallel_load:
        loaded = run_ranks(_load_plain, 2, path, None, timeout=240)
        _check_slices(full, [held for held, *_ in loaded])
        assert all(position == {"epoch": 0, "batches": taken // (2 * MICRO), "samples": taken}
                   for *_, position, _ in loaded)
        assert sorted(s for *_, rest in loaded for s in rest) == sorted(order[taken:])


def test_pipe2_x_sequence2_loads_in_one_process(tmp_path):
    """pipe 2 x sequence 2 (4 ranks, ZeRO-1 over data x sequence)."""
    _check(tmp_path, 4, 2, 1, 2)


def test_pipe2_x_sequence2_without_zero_loads_in_one_process(tmp_path):
    """pipe 2 x sequence 2 (4 ranks, no ZeRO): the stage's replicas over
    data x sequence split the writing of its whole tensors."""
    _check(tmp_path, 4, 2, 1, 2, stage=0)


def test_tensor2_x_sequence2_loads_in_one_process(tmp_path):
    """tensor 2 x sequence 2 (4 ranks, ZeRO-1 over data x sequence); loaded
    in one process and on 2 data-parallel ranks."""
    _check(tmp_path, 4, 1, 2, 2, data_parallel_load=True)


@pytest.mark.parametrize("pipe,tensor,stage", [(1, 2, 3), pytest.param(1, 2, 2, marks=pytest.mark.slow),
                                                pytest.param(2, 1, 2, marks=pytest.mark.slow)])
def test_sequence2_at_zero_2_and_3_loads_in_one_process(tmp_path, pipe, tensor, stage):
    """tensor 2 x sequence 2 at ZeRO-3 (and, slow, ZeRO-2; pipe 2 x sequence
    2 at ZeRO-2), 4 ranks."""
    _check(tmp_path, 4, pipe, tensor, 2, stage=stage)


@pytest.mark.slow
def test_pipe2_x_tensor2_x_sequence2_loads_in_one_process(tmp_path):
    """pipe 2 x tensor 2 x sequence 2 on 8 ranks, ZeRO-1; loaded in one
    process and on 2 data-parallel ranks."""
    _check(tmp_path, 8, 2, 2, 2, data_parallel_load=True)


@pytest.mark.slow
def test_tensor2_x_sequence2_x_data2_loads_in_one_process(tmp_path):
    """tensor 2 x sequence 2 x data 2 on 8 ranks, ZeRO-1."""
    _check(tmp_path, 8, 1, 2, 2)
