"""One declaration of the parallel degrees (runtime/parallel/degrees.py):
`dsrun.init_distributed(config=...)` builds the mesh before the model, so
that DeepSpeed's `groups` answers come from it; `initialize` keeps that mesh
(the layers hold its groups), refuses other degrees before any collective,
and trains to the losses of one process. 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_ulysses import TOL, _train


def _groups_after_declaration():
    import dsrun
    from dsrun.utils import groups

    out = {}
    dsrun.init_distributed(config={"train_batch_size": 4, "sequence_parallel_size": 2})
    out["sequence"] = (groups._get_sequence_parallel_world_size(), groups._get_data_parallel_world_size(),
                       groups._get_data_parallel_group_ranks(), groups._get_sequence_data_parallel_world_size())
    dsrun.init_distributed(config={"pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2}})
    out["pipe_tensor"] = (groups._get_model_parallel_world_size(), groups.get_tensor_model_parallel_world_size(),
                          groups._get_data_parallel_world_size(), groups.get_tensor_model_parallel_group() is not None)
    from dsrun.runtime.config import ConfigError
    try:
        dsrun.init_distributed(config={"tensor_parallel": {"autotp_size": 3}})
    except ConfigError as exc:
        out["error"] = str(exc)
    return out


def test_init_distributed_with_a_config_builds_the_mesh():
    results = run_ranks(_groups_after_declaration, 4, timeout=120)
    for rank, out in enumerate(results):
        # axes data, sequence (sequence innermost): data ranks differ by 2
        assert out["sequence"] == (2, 2, [rank % 2, rank % 2 + 2], 4)
        assert out["pipe_tensor"] == (4, 2, 1, True)  # pipe x model = the whole job, no data parallelism
        assert "pipeline x tensor x sequence = 1 x 3 x 1 = 3 ranks does not divide the 4 ranks" in out["error"]


def _declared_then_trained():
    from dsrun.runtime.parallel.mesh import ParallelMesh

    built = []
    original = ParallelMesh.__init__

    def counting(self, topology):
        original(self, topology)
        built.append(self.size("sequence"))

    ParallelMesh.__init__ = counting
    losses, params = _train(2, declared=True)
    return losses, params, built


def _one_process():
    import dsrun

    dsrun.init_distributed()
    return _train(1)


def test_layers_built_on_the_declared_mesh_train_as_one_process():
    """sequence 2 x data 2 declared by init_distributed(config=), the model's
    DistributedAttention built after it on groups._get_sequence_parallel_group():
    initialize keeps that mesh, and the run equals one process (fp32, 1e-5)."""
    want_loss, want_params = run_ranks(_one_process, 1, timeout=120)[0]
    results = run_ranks(_declared_then_trained, 4, timeout=180)
    for losses, params, built in results:
        assert built.count(2) == 1  # one sequence mesh, built by init_distributed; initialize kept it
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), **TOL)
        torch.testing.assert_close(params, want_params, **TOL)


def _initialize_with_other_degrees():
    import dsrun
    from dsrun.runtime.config import ConfigError

    dsrun.init_distributed(config={"sequence_parallel_size": 2})
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError) as raised:
        dsrun.initialize(model=model, config={"train_batch_size": 4,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return str(raised.value)


def test_initialize_refuses_degrees_other_than_the_declared_ones():
    """Raised on every rank, from the resolution of the degrees (before the
    mesh's groups are made or the model is broadcast)."""
    for message in run_ranks(_initialize_with_other_degrees, 2, timeout=60):
        assert "init_distributed(config=...) declared pipe 1 x tensor 1 x sequence 2" in message
        assert "initialize() finds pipe 1 x tensor 1 x sequence 1" in message
