"""Checkpoints reshard across tensor-parallel sizes (issue 25 item 4; see
[Note: tensor-parallel checkpoints] in dsrun/runtime/checkpoint/tensor_split.py).

A tiny Hugging Face GPT-2 (fused q/k/v in a transposed Conv1D) and a tiny
Llama (2 key/value heads: replicated at tp=4) are sharded by AutoTP,
trained 2 AdamW steps at tp=2 (x dp=1, ZeRO off; x dp=2, ZeRO-1 and 3), saved,
and loaded at tp=1 (the plain model, one rank) and tp=4 (4 ranks). Every
rank's parameter slice and Adam moments after the load equal, bit for bit,
the elements of the full tensors put together from the tp=2 ranks' slices
at save time; the next step's loss equals the uninterrupted tp=2 run's
(rtol = atol = 1e-5: the layouts sum their matmuls in other orders);
`dsrun-ckpt export` of the tp=2 checkpoint and `save_16bit_model` at tp=2
give the plain model's state dict after the load, bit for bit; every stored
tensor is covered once (replicated parameters written once). pp=2 x tp=2
x dp=2 (ZeRO-1) loads at pp=2 x tp=1 and unsplit likewise.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_autotp import _build, _ids, _lm_loss

TOL = {"rtol": 1e-5, "atol": 1e-5}
STEPS = 2
BATCH = 8


def _config(stage: int, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def _engine(kind: str, tp: int, stage: int):
    import torch.distributed as dist

    import dsrun
    dsrun.init_distributed()
    model = _build(kind)
    if tp > 1:
        model = dsrun.tp_model_init(model, tp, torch.float32)
    dp = dist.get_world_size() // tp
    engine, *_ = dsrun.initialize(model=model, config=_config(stage, BATCH // dp))
    return engine, dist.get_rank() // tp, BATCH // dp


def _step(kind: str, engine, data_rank: int, micro: int, step: int) -> float:
    """One step on the global batch of `step`; the mean loss over all samples."""
    import torch.distributed as dist
    batch = _ids(100 + step, batch=BATCH)[data_rank * micro:(data_rank + 1) * micro]
    loss = _lm_loss(kind, engine, batch)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # tensor-parallel ranks hold the same loss
    return float(mean) / dist.get_world_size()


def _slices(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Parameter name -> (positions of this rank's elements in the full
    flattened tensor, values, exp_avg, exp_avg_sq), fp32 masters (collective
    under ZeRO)."""
    from dsrun.runtime.parallel.tensor.split import split_of
    strategy, out = engine.strategy, {}
    for name, p in engine.module.named_parameters():
        if strategy.manages(p):
            value = strategy.full_fp32_param(p)
            states = [strategy.full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
        else:
            value = p.detach()
            states = [engine.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")]
        split = split_of(p)
        positions = split.local_index().view(-1) if split is not None else torch.arange(p.numel())
        out[name] = (positions, value.detach().reshape(-1).cpu().clone(),
                     *(s.reshape(-1).cpu().clone() for s in states))
    return out


def _save(kind: str, tp: int, stage: int, path: str):
    """Train STEPS steps at tp, save, take one more step. Returns (slices at
    save time, the next step's loss)."""
    engine, data_rank, micro = _engine(kind, tp, stage)
    for step in range(STEPS):
        _step(kind, engine, data_rank, micro, step)
    engine.save_checkpoint(path, tag="t")
    held = _slices(engine)
    engine.save_16bit_model(path + "-16bit")  # fp32 training: the fp32 values
    return held, _step(kind, engine, data_rank, micro, STEPS), path + "-16bit/model.safetensors"


def _load(kind: str, tp: int, stage: int, path: str, export_dir: str | None):
    """Load at tp, take the next step. Returns (slices after the load, the
    step's loss, the module's state dict (rank 0, when export_dir: the
    export of the checkpoint beside it))."""
    engine, data_rank, micro = _engine(kind, tp, stage)
    engine.load_checkpoint(path, tag="t")
    held = _slices(engine)
    state, exported = None, None
    if export_dir is not None:
        import os

        from safetensors.torch import load_file

        from dsrun.runtime.checkpoint.cli import export_hf
        export_hf(os.path.join(path, "t"), export_dir, torch.float32, 1 << 40)
        exported = load_file(os.path.join(export_dir, "model.safetensors"))
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return held, _step(kind, engine, data_rank, micro, STEPS), state, exported


def _full(per_rank: list[dict]) -> dict[str, list[torch.Tensor]]:
    """The full flattened tensors (value, exp_avg, exp_avg_sq) put together
    from every rank's slices; each element must be held alike by all the
    ranks holding it."""
    out = {}
    for name in set().union(*per_rank):
        holders = [r for r in per_rank if name in r]  # a pipeline stage's ranks hold its parameters
        numel = max(int(r[name][0].max()) for r in holders) + 1
        full = [torch.full((numel,), float("nan")) for _ in range(3)]
        for r in holders:
            positions, *values = r[name]
            for f, v in zip(full, values):
                f[positions] = v
        for r in holders:  # replicas (data ranks, replicated key/value heads, tied copies) agree
            positions, *values = r[name]
            for f, v in zip(full, values):
                assert torch.equal(f[positions], v), name
        assert not any(f.isnan().any() for f in full), name
        out[name] = full
    return out


def _check_stored_once(path: str) -> None:
    """Every stored tensor's slices cover it exactly once (replicated
    parameters, replicated key/value heads and data replicas written once)."""
    import os

    from dsrun.runtime.checkpoint.store import load_index
    index = load_index(os.path.join(path, "t"))
    assert index.tensor_parallel == 2
    for name, entry in index.tensors.items():
        if name.startswith(("module/", "optim/")):
            ends = [(s.lo, s.hi) for s in entry.slices]
            assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])), name
            assert ends[-1][1] == torch.Size(entry.shape).numel(), name


def _check_slices(full: dict, per_rank: list[dict]) -> None:
    for r in per_rank:
        assert set(r) == set(full)
        for name, (positions, *values) in r.items():
            for what, f, v in zip(("value", "exp_avg", "exp_avg_sq"), full[name], values):
                assert torch.equal(f[positions], v), f"{name} {what} differs after the load"


@pytest.mark.parametrize("kind,save_world,stage", [("gpt2", 2, 0), ("llama", 2, 0), ("gpt2", 4, 1),
                                                     ("llama", 4, 1), ("llama", 4, 3)])
def test_tp2_checkpoint_loads_at_tp1_and_tp4(kind, save_world, stage, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, save_world, kind, 2, stage, path, timeout=240)
    full = _full([held for held, *_ in saved])
    next_loss = saved[0][1]
    _check_stored_once(path)

    plain = run_ranks(_load, 1, kind, 1, stage, path, str(tmp_path / "export"), timeout=240)
    _check_slices(full, [plain[0][0]])
    torch.testing.assert_close(plain[0][1], next_loss, **TOL)
    state, exported = plain[0][2], plain[0][3]
    assert set(exported) <= set(state) and set(state) - set(exported) <= {"lm_head.weight"}  # GPT-2 ties it
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name
    from safetensors.torch import load_file
    sixteen = load_file(saved[0][2])  # engine.save_16bit_model at tp=2
    assert set(sixteen) == set(exported)
    for name, value in exported.items():
        assert torch.equal(value, sixteen[name]), name

    tp4 = run_ranks(_load, 4, kind, 4, stage, path, None, timeout=240)
    _check_slices(full, [held for held, *_ in tp4])
    torch.testing.assert_close(tp4[0][1], next_loss, **TOL)


# -- pipeline x tensor x data ------------------------------------------------------------------
def _pipe_engine(pipe: int, model: int):
    """test_autotp's 4-block PipelineModule (Megatron MLP blocks, a tied
    replicated layer, a replicated head) on the pipe x model x data mesh of
    the job, ZeRO-1; its train_batch's batches for one step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from tests.parallel.test_autotp import GAS, HIDDEN, MICRO_SAMPLES, _TPBlock
    dsrun.init_distributed()
    mesh = ParallelMesh.build(dist.get_world_size(), pipe=pipe, model=model)
    set_current(mesh)
    tied = TiedLayerSpec("io", torch.nn.Linear, HIDDEN, HIDDEN, bias=False)
    layers = [tied] + [LayerSpec(_TPBlock, HIDDEN) for _ in range(4)] + [tied, LayerSpec(torch.nn.Linear, HIDDEN, 2)]
    module = PipelineModule(layers, loss_fn=F.mse_loss, topology=mesh.topology, seed_layers=True,
                            partition_method="uniform")
    micro = MICRO_SAMPLES // mesh.size("data")
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=module, config=cfg)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(GAS * MICRO_SAMPLES, HIDDEN, generator=gen)
    ys = torch.randn(GAS * MICRO_SAMPLES, 2, generator=gen)
    d = mesh.rank("data")
    batches = [(xs[k * MICRO_SAMPLES + d * micro:k * MICRO_SAMPLES + (d + 1) * micro],
                ys[k * MICRO_SAMPLES + d * micro:k * MICRO_SAMPLES + (d + 1) * micro]) for k in range(GAS)]
    return engine, batches


def _pipe_run(pipe: int, model: int, path: str, save: bool):
    """save: STEPS steps, save, one more; else: load, one step. Returns
    (slices after the save or load, the last step's loss)."""
    engine, batches = _pipe_engine(pipe, model)
    if save:
        for _ in range(STEPS):
            engine.train_batch(iter(batches))
        engine.save_checkpoint(path, tag="t")
    else:
        engine.load_checkpoint(path, tag="t")
    held = _slices(engine)
    return held, float(engine.train_batch(iter(batches)))


def test_pipe_tp2_checkpoint_loads_at_tp1_and_unsplit(tmp_path):
    """pp=2 x tp=2 x dp=2 (8 ranks, ZeRO-1) saved; loaded at pp=2 x tp=1 x
    dp=2 and into the unsplit model (one stage, tp=1, dp=2): slices and Adam
    moments bitwise, the next loss to TOL."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_pipe_run, 8, 2, 2, path, True, timeout=400)
    full = _full([held for held, _ in saved])
    next_loss = saved[-1][1]  # the last stage's loss
    for pipe in (2, 1):
        loaded = run_ranks(_pipe_run, 4 if pipe == 2 else 2, pipe, 1, path, False, timeout=300)
        per_rank = [held for held, _ in loaded]
        assert set().union(*per_rank) == set(full)
        for held in per_rank:
            _check_slices({n: full[n] for n in held}, [held])
        torch.testing.assert_close(loaded[-1][1], next_loss, **TOL)


def _check_splits(kind: str, tp: int) -> None:
    """Each sharded parameter is exactly `tp_split.take` of the unsharded
    model's tensor of the same name (GPT-2's fused, transposed c_attn;
    Llama's key/value heads replicated at tp=4)."""
    import dsrun
    dsrun.init_distributed()
    plain = dict(_build(kind).named_parameters())
    model = dsrun.tp_model_init(_build(kind), tp, torch.float32)
    split_names = []
    for name, p in model.named_parameters():
        split = getattr(p, "tp_split", None)
        if split is None:
            assert torch.equal(p, plain[name]), name
            continue
        assert (split.rank, split.size, split.full_shape) == (torch.distributed.get_rank(), tp,
                                                               tuple(plain[name].shape)), name
        assert torch.equal(split.take(plain[name].detach()), p.detach()), name
        split_names.append(name)
    assert split_names


@pytest.mark.parametrize("kind,tp", [("gpt2", 2), ("llama", 4), ("gpt", 2)])
def test_split_takes_the_sharded_slice(kind, tp):
    run_ranks(_check_splits, tp, kind, tp, timeout=120)
