"""The curricula in training: curriculum_seqlen reaches forward and the
token count follows it, LR steps in tokens, curriculum sampling draws only
easy samples early, a resume mid-curriculum continues the same difficulties
and batches (2 gloo ranks, real checkpoints), and the pipeline engine
truncates the micro-batches (2 stages)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_helpers import run_ranks

SEQ, VOCAB = 32, 16
LEGACY = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": SEQ,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 8}}


def _want(step: int) -> int:  # LEGACY's difficulty at step (DeepSpeed's formula, by hand)
    return min(SEQ, max(8, (int(step / 6 * (SEQ - 8) + 8) // 8) * 8))


class _SeqModel(torch.nn.Module):
    """Token ids [batch, seq] -> mean loss; truncates to curriculum_seqlen as Megatron's GPT does,
    and records what it was given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)
        self.seen: list = []

    def forward(self, ids, curriculum_seqlen=None):
        self.seen.append(curriculum_seqlen)
        if curriculum_seqlen is not None:
            ids = ids[:, :curriculum_seqlen]
        logits = self.out(self.emb(ids[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class _Tokens(torch.utils.data.Dataset):
    """Sample i: SEQ token ids whose first i % SEQ + 1 are nonzero (its 'length', the metric)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[: i % SEQ + 1] = 1 + torch.arange(i % SEQ + 1) % (VOCAB - 1)
        return ids


def _length(sample: torch.Tensor) -> int:
    return int((sample != 0).sum())


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def _forward_kwargs_and_tokens() -> dict:
    import dsrun
    engine, *_ = dsrun.initialize(model=_SeqModel(), config=_config(
        curriculum_learning={**LEGACY, "lr_schedule_in_tokens": True},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                  "warmup_num_steps": 4, "warmup_type": "linear"}}))
    ids = torch.ones(2, SEQ, dtype=torch.long)
    tokens, lrs = [], []
    for _ in range(4):
        for _ in range(2):
            engine.backward(engine(ids))
            if engine.is_gradient_accumulation_boundary():
                tokens.append(engine._telemetry._tokens)  # the step's count, before end_step resets it
            engine.step()
        lrs.append(engine.get_lr()[0])
    engine.eval()
    with torch.no_grad():
        engine(ids)
    return {"seen": engine.module.seen, "lrs": lrs, "tokens": tokens, "full_steps": engine.lr_scheduler.full_steps}


def test_curriculum_seqlen_reaches_forward_tokens_and_lr_follow_it():
    got = run_ranks(_forward_kwargs_and_tokens, 1, timeout=120)[0]
    wanted = [_want(s) for s in (1, 2, 3, 4)]
    assert wanted == [8, 16, 16, 24]
    assert got["seen"] == [w for w in wanted for _ in range(2)] + [None]  # eval forwards get none
    assert got["tokens"] == [2 * 2 * w for w in wanted]  # 2 micro-batches of 2 sequences, truncated
    # WarmupLR linear over 4 full-length steps, advanced by the share of a full step each step took;
    # the schedule starts at iteration -1 (min lr), one full step done is iteration 0
    done = 0.0
    for want, lr in zip(wanted, got["lrs"]):
        done += want / SEQ
        assert lr == pytest.approx(0.0 if done < 1 else min(1.0, (done - 1) / 4))
    assert got["full_steps"] == pytest.approx(sum(w / SEQ for w in wanted)) and got["lrs"][-1] > 0


def test_monitor_tokens_count_the_truncated_sequences():
    from dsrun.runtime.data_pipeline.curriculum import tokens_of
    ids = torch.ones(4, SEQ, dtype=torch.long)
    assert tokens_of(ids, 8) == 32 and tokens_of(ids, None) == 4 * SEQ and tokens_of(ids, 1000) == 4 * SEQ


def _sampler(difficulty_type: str, lo: int, hi: int, seed: int = 7):
    from dsrun.runtime.config import load_config
    from dsrun.runtime.data_pipeline.data_sampling import CurriculumSampler, metric_values
    metric = {"difficulty_type": difficulty_type, "min_difficulty": lo, "max_difficulty": hi,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1}}
    cfg = load_config({**_config(), "data_efficiency": {"enabled": True, "seed": seed, "data_sampling": {
        "enabled": True, "curriculum_learning": {"enabled": True, "curriculum_metrics": {"length": metric}}}}})
    section = cfg.data_efficiency.data_sampling.curriculum_learning
    return CurriculumSampler({"length": metric_values(_Tokens(), _length)}, section, 8, seed)


def test_curriculum_sampling_draws_only_easy_samples_early():
    lengths = [_length(_Tokens()[i]) for i in range(64)]
    value = _sampler("value", 4, SEQ)
    for step in range(1, 13):
        batch = value.draw(step)
        limit = value.schedulers["length"].get_current_difficulty()
        assert limit == min(SEQ, int(step / 10 * (SEQ - 4) + 4))
        assert len(batch) == 8 and max(lengths[i] for i in batch) <= limit
        assert len(set(batch)) == 8  # without replacement when enough are eligible
    value.draw(1)  # a step drawn again after max_difficulty: DeepSpeed's update never lowers it
    assert len(value.eligible()) == 64
    percentile = _sampler("percentile", 10, 100)
    for step in (1, 5, 10):
        share = percentile.schedulers["length"].get_difficulty(step)
        batch = percentile.draw(step)
        easiest = sorted(range(64), key=lambda i: (lengths[i], i))[:64 * share // 100]
        assert set(batch) <= set(easiest)
    # deterministic per seed and step, different for another seed
    assert _sampler("value", 4, SEQ).draw(3) == _sampler("value", 4, SEQ).draw(3)
    assert _sampler("value", 4, SEQ).draw(3) != _sampler("value", 4, SEQ, seed=8).draw(3)


def test_curriculum_loader_splits_each_step_over_data_ranks():
    from dsrun.runtime.data_pipeline.data_sampling import CurriculumDataLoader
    loaders = [CurriculumDataLoader(_Tokens(), _sampler("value", 4, SEQ), 2, 2, r, 2) for r in range(2)]
    its = [iter(x) for x in loaders]
    for step in range(1, 4):
        want = _sampler("value", 4, SEQ).draw(step)
        got = []
        for k in range(2):
            for it in its:
                got += next(it).ne(0).sum(dim=1).tolist()
        lengths = [_length(_Tokens()[i]) for i in want]
        assert got == lengths[0:2] + lengths[2:4] + lengths[4:6] + lengths[6:8]


SAMPLING = {"enabled": True, "seed": 3, "data_sampling": {"enabled": True, "curriculum_learning": {
    "enabled": True, "curriculum_metrics": {"length": {
        "min_difficulty": 2, "max_difficulty": SEQ, "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2, "root_degree": 2}}}}}}


def _engine_and_loader():
    import dsrun
    engine, *_ = dsrun.initialize(model=_SeqModel(), config=_config(curriculum_learning=LEGACY,
                                                                     data_efficiency=SAMPLING))
    loader = engine.deepspeed_io(_Tokens(), difficulty_metrics={"length": _length})
    return engine, loader


def _train(engine, batches, steps: int) -> list:
    """(curriculum_seqlen, lengths of this rank's samples) of each micro-batch."""
    out = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids = next(batches)
        engine.backward(engine(ids))
        engine.step()
        out.append((engine.module.seen[-1], ids.ne(0).sum(dim=1).tolist()))
    return out


def _save_then_continue(ckpt: str) -> list:
    engine, loader = _engine_and_loader()
    batches = iter(loader)
    _train(engine, batches, 3)
    engine.save_checkpoint(ckpt, tag="mid")
    return _train(engine, batches, 4)


def _load_then_continue(ckpt: str) -> list:
    engine, loader = _engine_and_loader()
    engine.load_checkpoint(ckpt, tag="mid")
    assert engine.global_steps == 3
    return _train(engine, iter(loader), 4)


def test_resume_mid_curriculum_continues_difficulties_and_batches(tmp_path):
    ckpt = str(tmp_path)
    straight = run_ranks(_save_then_continue, 2, ckpt, timeout=180)
    with open(os.path.join(ckpt, "mid", "index.json")) as f:
        states = json.load(f)["states"]
    assert states["curriculum_learning"]["current_difficulty"] == _want(3)
    assert states["data_sampling"]["step"] == 3
    resumed = run_ranks(_load_then_continue, 2, ckpt, timeout=180)
    assert resumed == straight
    for rank in straight:
        assert [seqlen for seqlen, _ in rank] == [_want(s) for s in (4, 5, 6, 7) for _ in range(2)]
    # each rank's samples are within the sampler's difficulty: fixed_root over 8 steps, degree 2
    for step in range(4):
        limit = min(SEQ, int(((step + 4) / 8) ** 0.5 * (SEQ - 2) + 2) // 2 * 2)
        for rank in straight:
            for _, lengths in rank[2 * step:2 * step + 2]:
                assert max(lengths) <= limit


class _NoSeqlen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids):
        return self.w * ids.float().mean()


def _initialize_paths() -> dict:
    import dsrun
    metric = {"metric_fn": "tests.data_pipeline.test_curriculum_training:_length", "min_difficulty": 3,
              "max_difficulty": SEQ, "schedule_type": "custom"}
    sampling = {**SAMPLING, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": {"length": metric}}}}
    engine, _, loader, _ = dsrun.initialize(model=_SeqModel(), training_data=_Tokens(), config=_config(
        curriculum_learning={**LEGACY, "schedule_type": "custom"}, data_efficiency=sampling))
    out = {"loader": type(loader).__name__}
    engine.set_custom_curriculum_learning_schedule(lambda step: 3 + step)  # both: legacy and the metric
    first = next(iter(loader))
    out["first_lengths"] = first.ne(0).sum(dim=1).tolist()
    engine.backward(engine(first))
    out["seqlen"] = engine.module.seen[-1]
    plain, *_ = dsrun.initialize(model=_SeqModel(), config=_config())
    try:
        plain.set_custom_curriculum_learning_schedule(lambda step: 1)
    except ValueError as e:
        out["no_custom"] = str(e)
    wrong, *_ = dsrun.initialize(model=_NoSeqlen(), config=_config(curriculum_learning=LEGACY))
    try:
        wrong(torch.ones(2, SEQ, dtype=torch.long))
    except TypeError as e:
        out["no_kwarg"] = str(e)
    return out


def test_initialize_builds_the_sampler_from_metric_fn_and_custom_schedules():
    got = run_ranks(_initialize_paths, 1, timeout=120)[0]
    assert got["loader"] == "CurriculumDataLoader"
    assert max(got["first_lengths"]) <= 4 and got["seqlen"] == 4  # custom: 3 + step 1
    assert "no curriculum has schedule_type 'custom'" in got["no_custom"]
    assert "_NoSeqlen.forward, which takes no such argument" in got["no_kwarg"]
