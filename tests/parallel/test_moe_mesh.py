"""MoE beside tensor parallelism and inside a pipeline (gloo).

- tp=2 x dp=2 with an MoE layer at ep_size 2 (expert groups on the data axis
  of each model rank; the experts replicated over the model axis, counted
  once in the clipping norm) trains like dp=4 at ep_size 2 with the same
  samples: dropless routing, so the tokens' grouping does not change the
  outputs. ZeRO 0, 2 and 3.
- pipe=2 x dp=2 with an MoE layer at ep_size 2 on the first stage trains
  like the same PipelineModule on one stage x dp=2.
- a tp=2 x ep=2 checkpoint (zero_to_fp32) and 16-bit export load into the
  model at tp=1, ep_size=1.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks, train_steps

H, BATCH, TOL = 8, 8, {"rtol": 1e-5, "atol": 1e-6}


def _distinct_experts(module) -> None:
    """Every expert parameter from a seed of its global name (names.py)."""
    from dsrun.runtime.parallel.expert.names import global_expert_name
    from dsrun.runtime.parallel.mesh import current
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".deepspeed_experts." in name:
                global_name = global_expert_name(name, p, current())  # the mesh the layers were built on
                seed = int(global_name.split(".deepspeed_experts.")[1].split(".")[0]) * 10 + p.dim()
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def _tp_train(model_size: int, stage: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.moe.layer import MoE
    from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from tests.parallel.test_autotp import _TPBlock
    mesh = ParallelMesh.build(dist.get_world_size(), model=model_size)
    set_current(mesh)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.block = _TPBlock(H)
            self.moe = MoE(H, torch.nn.Linear(H, H), num_experts=4, ep_size=2, k=1, drop_tokens=False,
                           min_capacity=1)
            self.head = torch.nn.Linear(H, 1)

        def forward(self, x, y):
            h = self.block(x)
            m, l_aux, _ = self.moe(h)
            return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.0 * l_aux  # l_aux depends on the grouping

    net = Net()
    _distinct_experts(net)
    micro = BATCH // mesh.size("data")
    params = split_params_into_different_moe_groups_for_optimizer({"params": net.parameters(), "name": "p"})
    engine, *_ = dsrun.initialize(model=net, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.05, "steps_per_print": 1000, "zero_optimization": {"stage": stage}})
    d = mesh.rank("data")

    def loss_of(step: int):
        gen = torch.Generator().manual_seed(step)
        xs, ys = torch.randn(BATCH, H, generator=gen), torch.randn(BATCH, generator=gen)
        return engine(xs[d * micro:(d + 1) * micro], ys[d * micro:(d + 1) * micro])

    losses, norms = train_steps(engine, 3, loss_of)
    engine.destroy()
    set_current(None)
    return losses, norms


def _tp_vs_dp(stage: int):
    import dsrun
    dsrun.init_distributed()
    return _tp_train(1, stage), _tp_train(2, stage)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_moe_beside_tensor_parallelism_trains_like_data_parallel(stage):
    """4 ranks: tp=2 x dp=2 against dp=4, both at ep_size 2: losses and
    clipped norms (clipping at 0.05, below the norm) equal to 1e-5 on every
    rank."""
    for (want_loss, want_norm), (got_loss, got_norm) in run_ranks(_tp_vs_dp, 4, stage, timeout=240):
        torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
        torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
        assert want_norm[0] > 0.05


class _MoEBlock(torch.nn.Module):
    """x + MoE(x) with 2 experts at ep_size `ep` (l_aux left out here;
    tests/parallel/test_pipe_moe.py carries it between the stages)."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from dsrun.moe.layer import MoE
        self.moe = MoE(H, torch.nn.Linear(H, H), num_experts=2, ep_size=ep, min_capacity=1, use_rts=False)

    def forward(self, x):
        return x + self.moe(x)[0]


def _pipe_train(pipe: int) -> list[tuple[float, float]]:
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    dsrun.init_distributed()
    mesh = ParallelMesh.build(dist.get_world_size(), pipe=pipe)
    set_current(mesh)
    layers = [LayerSpec(torch.nn.Linear, H, H), LayerSpec(_MoEBlock, 2), LayerSpec(torch.nn.Linear, H, 2)]
    module = PipelineModule(layers, loss_fn=F.mse_loss, topology=mesh.topology, partition_method="uniform",
                            seed_layers=True)
    _distinct_experts(module)
    engine, *_ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000})
    gen = torch.Generator().manual_seed(7 + mesh.rank("data"))
    batches = [(torch.randn(4, H, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(2)]
    return [(float(engine.train_batch(iter(batches))), engine.get_global_grad_norm()) for _ in range(3)]


def test_moe_inside_a_pipeline_trains_like_one_stage():
    """pipe=2 x dp=2 (4 ranks) against pipe=1 x dp=2 (2 ranks), the MoE
    layer at ep_size 2 on the first stage: losses and norms to 1e-5."""
    want = run_ranks(_pipe_train, 2, 1, timeout=120)[0]
    got = run_ranks(_pipe_train, 4, 2, timeout=180)[-1]  # the last stage's loss
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    assert want[0][1] > 0.05


class _TPNet(torch.nn.Module):
    """A Megatron MLP block (tensor-parallel on the current mesh) then an
    MoE layer of 4 experts at ep_size `ep`."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from dsrun.moe.layer import MoE
        from tests.parallel.test_autotp import _TPBlock
        torch.manual_seed(0)
        self.block = _TPBlock(H)
        self.moe = MoE(H, torch.nn.Linear(H, H), num_experts=4, ep_size=ep, k=1, drop_tokens=False, min_capacity=1)
        self.head = torch.nn.Linear(H, 1)

    def forward(self, x):
        h = self.block(x)
        m, _, _ = self.moe(h)
        return self.head(h + m)


def _tp_save_and_load_plain(save_dir: str) -> dict:
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    import dsrun
    from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    dsrun.init_distributed()
    set_current(ParallelMesh.build(dist.get_world_size(), model=2))
    net = _TPNet(2)
    _distinct_experts(net)
    engine, *_ = dsrun.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 1000})
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3 + dist.get_rank() // 2))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    engine.save_16bit_model(save_dir, "model.safetensors")
    with torch.no_grad():
        want = engine(x)
    engine.destroy()
    set_current(ParallelMesh.build(dist.get_world_size(), model=1))
    out = {}
    for what, state in (("16bit", load_file(os.path.join(save_dir, "model.safetensors"))),
                        ("zero_to_fp32", get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t"))):
        plain = _TPNet(1)
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            out[what] = float((plain(x) - want).abs().max())
    set_current(None)
    return out


def test_tp2_ep2_checkpoint_and_16bit_export_load_into_the_plain_model(tmp_path):
    """tp=2 x dp=2, ep_size 2, ZeRO-1: the 16-bit file and zero_to_fp32 of
    the checkpoint load strictly into the model at tp=1, ep_size=1 and give
    the trained model's outputs (to 1e-6) on every rank's samples."""
    for per_rank in run_ranks(_tp_save_and_load_plain, 4, str(tmp_path), timeout=240):
        assert per_rank["16bit"] < 1e-6 and per_rank["zero_to_fp32"] < 1e-6, per_rank
