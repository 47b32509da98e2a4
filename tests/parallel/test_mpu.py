"""`initialize(mpu=...)`: a Megatron-style model-parallel unit built on
torch.distributed groups (4 gloo ranks, tensor 2 x data 2) is adopted as the
job's mesh: ZeRO partitions over the mpu's own data group (the same process
group object), `dsrun.utils.groups` answers its ranks, and training equals
the same model sharded by `tensor_parallel.autotp_size` on dsrun's own mesh
(loss and clipped global gradient norm per step, fp32, 1e-5). The mpu lays
its ranks out data-innermost (tensor groups {0,2} {1,3}), unlike dsrun's
tensor-innermost mesh, so an ignored mpu would be seen. An mpu whose groups
overlap is an error naming the ranks."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks, train_steps
from tests.parallel.test_autotp import STEPS, TOL, _build, _config, _ids, _lm_loss


class _Mpu:
    """Megatron's parallel_state answers over explicit rank lists (every
    rank creates every group, in one order, as Megatron does)."""

    def __init__(self, tensor: list[list[int]], data: list[list[int]]):
        import torch.distributed as dist

        rank = dist.get_rank()
        self.tensor = self.data = None
        for kind, parts in (("tensor", tensor), ("data", data)):
            for ranks in parts:
                group = dist.new_group(ranks)
                if rank in ranks:
                    setattr(self, kind, group)

    def get_model_parallel_group(self):
        return self.tensor

    def get_model_parallel_world_size(self):
        return self.tensor.size()

    def get_model_parallel_rank(self):
        return self.tensor.rank()

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_world_size(self):
        return self.data.size()

    def get_data_parallel_rank(self):
        return self.data.rank()


def _train(mpu) -> tuple[list[float], list[float], dict]:
    """The byte GPT at tensor 2 x data 2, ZeRO-1, 8 samples per step split
    over the data ranks; (mean loss, global grad norm) per step and the groups."""
    import torch.distributed as dist

    import dsrun
    from dsrun.utils import groups

    model = _build("gpt")
    engine, *_ = dsrun.initialize(model=model, config=_config(1, 4, autotp=2), mpu=mpu)
    data_rank = groups._get_data_parallel_rank()
    seen = {"data_ranks": groups._get_data_parallel_group_ranks(),
            "tensor_ranks": list(dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())),
            "zero_group_is_the_mpus": mpu is not None and engine.strategy.groups.shard.group is mpu.data}
    batch = _ids(100, batch=8)[data_rank * 4:(data_rank + 1) * 4]
    losses, norms = train_steps(engine, STEPS, lambda _: _lm_loss("gpt", engine, batch))
    engine.destroy()
    return losses, norms, seen


def _mesh_vs_mpu():
    import dsrun
    from dsrun.runtime.parallel.mesh import set_current

    dsrun.init_distributed()
    want = _train(None)
    set_current(None)
    got = _train(_Mpu(tensor=[[0, 2], [1, 3]], data=[[0, 1], [2, 3]]))
    return want, got


def test_training_with_an_mpu_equals_autotp_on_the_mesh():
    for rank, ((want_loss, want_norm, mesh_groups), (got_loss, got_norm, mpu_groups)) in enumerate(
            run_ranks(_mesh_vs_mpu, 4, timeout=240)):
        assert mesh_groups["tensor_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]  # dsrun's own layout
        assert mpu_groups["tensor_ranks"] == [rank % 2, rank % 2 + 2]  # the mpu's
        assert mpu_groups["data_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert mpu_groups["zero_group_is_the_mpus"]
        torch.testing.assert_close(torch.tensor(got_loss), torch.tensor(want_loss), **TOL)
        torch.testing.assert_close(torch.tensor(got_norm), torch.tensor(want_norm), **TOL)
    assert want_loss[-1] < want_loss[0]  # it trains


def _overlapping_mpu() -> str:
    import dsrun
    from dsrun.runtime.parallel.mpu import MpuError

    dsrun.init_distributed()
    mpu = _Mpu(tensor=[[0, 1], [2, 3]], data=[[0, 1], [1, 2, 3]])
    with pytest.raises(MpuError) as raised:
        dsrun.initialize(model=torch.nn.Linear(2, 2), config=_config(1, 1), mpu=mpu)
    return str(raised.value)


def test_an_mpu_whose_groups_do_not_tile_the_world_is_an_error():
    for message in run_ranks(_overlapping_mpu, 4, timeout=120):
        assert "the mpu's data groups (0, 1) and (1, 2, 3) share rank 1" in message
