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

With experts: the same LM with an MoE MLP in each block (4 experts of
gate/up/down projections, each seeded from its global expert id), each
stage passing (hidden states, running auxiliary loss). Saved at pipe 2 x
data 2 (ZeRO-2) and tensor 2 x data 2 (ZeRO-1), experts at ep 2, on 4
ranks, and (slow) the issue's pipe 2 x tensor 2 x data 2 at ep 2 on 8;
loaded in one process (ep 1, every expert by its global id), and the
pipe 2 x data 2 one also on 4 data-parallel ranks at ep 4. The load is
another layout, so the RNG states are left alone (docs/checkpoints.md).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist_helpers import run_ranks
from tests.parallel.test_sequence_3d import (LAYERS, MICRO, SAMPLES, STEPS, WIDTH, Attention, Embed, Head, _batches,
                                             _seeded, token_mean_loss)
from tests.parallel.test_tp_checkpoint import _check_slices, _full, _slices

DATASET = 32      # samples of the engine's loader (integers: the sample is its index)
ADVANCED = 4      # micro-batches each rank takes from it before the save
EXPERTS, AUX = 4, 0.01  # experts per MoE layer; the auxiliary loss's coefficient


def _config(pipe: int, tensor: int, sequence: int, stage: int) -> dict:
    return {"train_batch_size": SAMPLES, "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 1000, "pipeline": {"stages": pipe}, "tensor_parallel": {"autotp_size": tensor},
            "sequence_parallel_size": sequence}


class _Expert(torch.nn.Module):
    """A SwiGLU MLP named like Llama's (AutoTP must leave it whole inside
    an MoE layer)."""

    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.up_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.down_proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class MoEEmbed(Embed):
    """ids -> (embeddings, a zero auxiliary loss to add to)."""

    def forward(self, ids):
        h = super().forward(ids)
        return h, h.new_zeros(())


class MoEBlock(torch.nn.Module):
    """(x, aux) -> (x + attention + MoE MLP, aux + the layer's l_aux); every
    expert seeded from its global id (names.py), so that a mix-up of
    experts across ranks shows."""

    def __init__(self, seed: int, ep: int):
        super().__init__()
        from dsrun.moe.layer import MoE
        from dsrun.runtime.parallel.expert.names import global_expert_name
        from dsrun.runtime.parallel.mesh import current
        _seeded(seed)
        self.input_norm = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.post_norm = torch.nn.LayerNorm(WIDTH)
        self.moe = MoE(WIDTH, _Expert(), num_experts=EXPERTS, ep_size=ep, k=1, drop_tokens=False, use_rts=False)
        with torch.no_grad():
            for name, p in self.moe.named_parameters():
                if ".deepspeed_experts." in name:
                    expert = int(global_expert_name(name, p, current()).split(".deepspeed_experts.")[1].split(".")[0])
                    g = torch.Generator().manual_seed(100 * seed + 10 * expert + p.dim())
                    p.copy_(torch.randn(p.shape, generator=g) / WIDTH ** 0.5)

    def forward(self, inputs):
        x, aux = inputs
        x = x + self.attn(self.input_norm(x))
        out, l_aux, _ = self.moe(self.post_norm(x))
        return x + out, aux + l_aux


class MoEHead(Head):
    def forward(self, inputs):
        x, aux = inputs
        return super().forward(x), aux


def _moe_layers(ep: int) -> list:
    from dsrun.pipe import LayerSpec
    return [LayerSpec(MoEEmbed, 1), LayerSpec(MoEBlock, 2, ep), LayerSpec(MoEBlock, 3, ep), LayerSpec(MoEHead, 4)]


def moe_loss(outputs, labels):
    """The token-mean loss plus the auxiliary loss the blocks carried."""
    logits, aux = outputs
    return token_mean_loss(logits, labels) + AUX * aux


def _engine(pipe: int, tensor: int, sequence: int, stage: int = 1, ep: int = 0):
    """The engine at the layout; ep > 0: the MoE LM with experts at ep."""
    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    cfg = _config(pipe, tensor, sequence, stage)
    data = int(os.environ["WORLD_SIZE"]) // (pipe * tensor * sequence)
    cfg["train_batch_size"] = max(SAMPLES, MICRO * data)  # a load on 4 data ranks: one micro-batch each
    dsrun.init_distributed(config=cfg)  # the mesh first: attention and experts take their groups from it
    specs = _moe_layers(ep) if ep else [LayerSpec(cls, seed) for cls, seed in LAYERS]
    if pipe > 1:
        model = PipelineModule(specs, num_stages=pipe, loss_fn=moe_loss if ep else token_mean_loss,
                               partition_method="uniform")
    else:
        model = torch.nn.Sequential(*(spec.build() for spec in specs))
    engine, *_ = dsrun.initialize(model=model, config=cfg, training_data=list(range(DATASET)))
    return engine


def _global_slices(engine) -> dict:
    """_slices keyed by global names (an expert by its global id)."""
    from dsrun.runtime.parallel.expert.names import global_expert_name
    params = dict(engine.module.named_parameters())
    return {global_expert_name(name, params[name], engine.mesh): held for name, held in _slices(engine).items()}


def _save(pipe: int, tensor: int, sequence: int, stage: int, path: str, ep: int = 0):
    """STEPS steps at the layout, the loader advanced ADVANCED micro-batches,
    save. Returns (slices at save time, the samples this rank's loader gave)."""
    from dsrun.utils import groups
    engine = _engine(pipe, tensor, sequence, stage, ep)
    loss_fn = moe_loss if ep else token_mean_loss
    batches = iter(_batches(sequence, groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()))
    for _ in range(2):
        if pipe > 1:
            engine.train_batch(batches)
        else:
            for _ in range(engine.gradient_accumulation_steps()):
                ids, labels = next(batches)
                engine.backward(loss_fn(engine(ids), labels))
                engine.step()
    loader = iter(engine.training_dataloader)
    given = [int(s) for _ in range(ADVANCED) for s in next(loader)]
    engine.save_checkpoint(path, tag="t")
    held = _global_slices(engine)
    engine.destroy()
    return held, given


def _load_plain(path: str, export_dir: str | None, ep: int = 0):
    """Load into the plain model on every rank (data parallelism only,
    ZeRO-1; ep > 0: the MoE LM with experts at ep). Returns (slices, the
    module's state dict and the export of the checkpoint (when export_dir),
    the loader's state and this rank's remaining samples of the epoch);
    asserts that the load left the RNG states alone (another layout)."""
    import random

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dsrun.runtime.checkpoint.cli import main as ckpt_cli
    engine = _engine(1, 1, 1, ep=ep)
    before = torch.get_rng_state(), random.getstate()
    engine.load_checkpoint(path, tag="t")
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    held = _global_slices(engine)
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
           data_parallel_load: bool = False, ep: int = 0, load_ep: int = 0) -> None:
    """Save at the layout on `world` ranks (ep > 0: the MoE LM, experts at
    ep); load in one process (and, with data_parallel_load, on 2
    data-parallel ranks; with load_ep, on load_ep data-parallel ranks at
    ep load_ep) and compare."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, world, pipe, tensor, sequence, stage, path, ep, timeout=480)
    full = _full([held for held, _ in saved])
    _check_stored_once(path)

    held, state, exported, position, rest = run_ranks(_load_plain, 1, path, str(tmp_path / "export"),
                                                      1 if ep else 0, timeout=240)[0]
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

    for ranks, at in ((2, 1 if ep else 0),) * data_parallel_load + ((load_ep, load_ep),) * bool(load_ep):
        loaded = run_ranks(_load_plain, ranks, path, None, at, timeout=240)
        for held, *_ in loaded:  # at ep > 1 a rank holds its own experts only
            _check_slices({name: full[name] for name in held}, [held])
        assert set().union(*(held for held, *_ in loaded)) == set(full)
        assert all(position == {"epoch": 0, "batches": taken // (ranks * MICRO), "samples": taken}
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


def test_pipe2_x_data2_with_experts_loads_in_one_process_and_at_ep4(tmp_path):
    """pipe 2 x data 2, experts at ep 2 (4 ranks, ZeRO-2); loaded in one
    process (ep 1) and on 4 data-parallel ranks at ep 4."""
    _check(tmp_path, 4, 2, 1, 1, stage=2, ep=2, load_ep=4)


def test_tensor2_x_data2_with_experts_loads_in_one_process(tmp_path):
    """tensor 2 x data 2, experts at ep 2 (4 ranks, ZeRO-1): AutoTP shards
    the attention and keeps the experts whole over the tensor ranks."""
    _check(tmp_path, 4, 1, 2, 1, ep=2)


@pytest.mark.slow
def test_pipe2_x_tensor2_x_data2_with_experts_loads_in_one_process(tmp_path):
    """The issue's layout: pipe 2 x tensor 2 x data 2 on 8 ranks, experts at
    ep 2, ZeRO-1; loaded in one process and on 2 data-parallel ranks."""
    _check(tmp_path, 8, 2, 2, 1, data_parallel_load=True, ep=2)


def _rng_states() -> tuple:
    """(torch's CPU generator, the tracker's "test-rng" state or None, Python's random)."""
    import random

    from dsrun.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    return torch.get_rng_state(), get_cuda_rng_tracker().get_states().get("test-rng"), random.getstate()


def _save_rng(path: str) -> tuple:
    """sequence 2 on 2 ranks: each rank's generators moved to states of its
    own (one drawn from, as a tensor-parallel region does), then saved."""
    import random

    import torch.distributed as dist

    from dsrun.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    engine = _engine(1, 1, 2)
    rank = dist.get_rank()
    get_cuda_rng_tracker().add("test-rng", 100 + rank)
    with get_cuda_rng_tracker().fork("test-rng"):
        torch.rand(3)
    torch.manual_seed(200 + rank)
    random.seed(300 + rank)
    engine.save_checkpoint(path, tag="t")
    states = _rng_states()
    engine.destroy()
    return states


def _load_rng(path: str, sequence: int) -> tuple:
    """Load at sequence `sequence` x data on 2 ranks; (states before, after)."""
    import random
    engine = _engine(1, 1, sequence)
    torch.manual_seed(7)
    random.seed(7)
    before = _rng_states()
    engine.load_checkpoint(path, tag="t")
    after = _rng_states()
    engine.destroy()
    return before, after


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and \
        (a[1] is None or torch.equal(a[1], b[1])) and a[2] == b[2]


def test_rng_states_are_restored_on_the_same_layout_only(tmp_path):
    """Saved at sequence 2 on 2 ranks: loaded at sequence 2, every rank gets
    its own torch, tracker and Python states back; loaded at data 2 (the
    same world size, stages and tensor degree, but every rank elsewhere in
    the mesh) nothing is restored."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rng, 2, path, timeout=180)
    assert not torch.equal(saved[0][0], saved[1][0])  # per-rank states
    for rank, (before, after) in enumerate(run_ranks(_load_rng, 2, path, 2, timeout=180)):
        assert not _same_states(before, saved[rank]) and _same_states(after, saved[rank]), rank
    for before, after in run_ranks(_load_rng, 2, path, 1, timeout=180):
        assert _same_states(after, before) and after[1] is None
