"""The engine on 2 gloo ranks takes its batch sizes from an enabled `elasticity` section."""
from __future__ import annotations

import torch

import dsrun
from tests.dist_helpers import run_ranks

# max 20, micro [1, 3] (version 0.1): global batch 18 on 1 2 3 6 9 18 ranks; on 2 ranks each
# rank holds 9 samples per step: micro-batch 3, 3 accumulation steps (test_compute.py, TIE).
CONFIG = {"elasticity": {"enabled": True, "max_train_batch_size": 20, "micro_batch_sizes": [1, 3],
                         "version": 0.1},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 36

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _elastic_rank() -> dict:
    dsrun.init_distributed()
    torch.manual_seed(0)
    engine, _, loader, _ = dsrun.initialize(model=torch.nn.Linear(1, 1), training_data=_Samples(),
                                            config=CONFIG)
    sizes, steps = [], []
    for batch in loader:
        sizes.append(len(batch))
        engine.backward(engine(batch).square().mean())
        engine.step()
        steps.append(engine.global_steps)
    return {"batch": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
            "accumulation": engine.gradient_accumulation_steps(), "sizes": sizes, "steps": steps}


def test_two_ranks_take_micro_batch_and_accumulation_from_elasticity():
    for got in run_ranks(_elastic_rank, 2, timeout=120):
        assert (got["batch"], got["micro"], got["accumulation"]) == (18, 3, 3)
        assert got["sizes"] == [3] * 6  # 36 samples / 2 ranks in micro-batches of 3
        assert got["steps"] == [0, 0, 1, 1, 1, 2]  # an optimizer step every 3 micro-batches
