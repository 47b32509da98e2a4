"""The legacy seqlen curriculum under the pipeline engine (2 stages, gloo):
each training micro-batch is truncated to the step's difficulty before the
first stage, so the stages train on the sequences a one-process model
truncated by hand trains on; evaluation reads whole sequences."""
from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.parallel.test_pipe_engine import _config, _layers, _micro_batch, _reference_model

SEQ, MICRO_BATCHES, STEPS = 16, 2, 4
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": SEQ,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 4}}
DIFFICULTY = [8, 12, 16, 16]  # steps 1-4: floor(s / 3 * 12 + 4) rounded down to a multiple of 4


def _train_pipeline() -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule
    from dsrun.runtime.distributed.dist import init_distributed
    init_distributed()
    module = PipelineModule(_layers(), num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                            partition_method="uniform")
    engine, *_ = dsrun.initialize(model=module, config={**_config(2, 1, MICRO_BATCHES, "1f1b", 0, False, 1),
                                                        "curriculum_learning": CURRICULUM})
    lengths = []
    _, first = next(iter(module.local_layers(0)))  # the stage's first layer
    first.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    losses = []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter([_micro_batch(step, 0, j, seq=SEQ)
                                                     for j in range(MICRO_BATCHES)]))))
    lengths_train = list(lengths)
    engine.eval_batch(iter([_micro_batch(9, 0, j, seq=SEQ) for j in range(MICRO_BATCHES)]))
    return {"losses": losses, "lengths": lengths_train, "eval_length": lengths[-1], "stage": engine.stage_id}


def _train_reference() -> list[float]:
    import torch.nn.functional as F
    model = _reference_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for j in range(MICRO_BATCHES):
            x, y = _micro_batch(step, 0, j, seq=SEQ)
            loss = F.cross_entropy(model(x[:, :DIFFICULTY[step]]), y) / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses


def test_pipeline_truncates_micro_batches_to_the_curriculum():
    results = run_ranks(_train_pipeline, 2, timeout=180)
    reference = _train_reference()
    for r in results:
        # both stages see the truncated sequence: the first its input, the second the activations
        assert r["lengths"] == [d for d in DIFFICULTY for _ in range(MICRO_BATCHES)], r
        assert r["eval_length"] == SEQ
        assert r["losses"] == pytest.approx(reference, rel=1e-4, abs=1e-5)
