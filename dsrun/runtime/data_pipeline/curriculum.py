"""The legacy `curriculum_learning` section in a training run: the scheduler
the engine builds, the pipeline's truncation of a micro-batch, the token
count of a truncated batch and the token-based LR adapter.

[Note: curriculum_seqlen]
DeepSpeed's engine, in training mode and with the legacy curriculum on,
calls `update_difficulty(global_steps + 1)` before every forward and passes
`curriculum_seqlen=<current difficulty>` to the model's forward; the model
truncates its own inputs (Megatron-DeepSpeed's GPT slices tokens, position
ids, labels and the mask to `[:, :curriculum_seqlen]`). Evaluation forwards
get nothing. DeepSpeed's PipelineEngine runs the scheduler but passes
nothing (its forward cannot take keyword arguments), so the pipeline's
stages never see the difficulty. dsrun's PipelineEngine instead truncates
each training micro-batch before the first stage: every tensor of two or
more dimensions among the inputs (first stage) and the labels (last stage)
is sliced to `[:, :curriculum_seqlen]` (dimension 1 is the sequence, as in
the batches `(tokens, labels)` of DeepSpeed's pipeline examples). The later
stages receive the shorter activations (p2p.py sends the shapes with each
micro-batch). A model whose sequence dimension is not dimension 1 must
truncate in its own first layer instead (set schedule_type and read
`engine.curriculum_scheduler_legacy.get_current_difficulty()`).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from dsrun.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler


def legacy_scheduler(config) -> CurriculumScheduler | None:
    """The scheduler of the config's `curriculum_learning` section (a
    DsConfig), or None when it is off."""
    section = config.curriculum_learning
    if not section.enabled:
        return None
    return CurriculumScheduler(section.model_dump(mode="json", include={"min_difficulty", "max_difficulty",
                                                                      "schedule_type", "schedule_config"}))


def check_takes_seqlen(module: torch.nn.Module) -> None:
    """Raise TypeError unless `module.forward` takes a `curriculum_seqlen`
    keyword (or **kwargs): the engine passes it under the seqlen curriculum.
    A forward whose signature cannot be read passes."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.name == "curriculum_seqlen" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise TypeError(f"curriculum_learning is enabled, so the engine passes curriculum_seqlen=<length> to "
                        f"{type(module).__name__}.forward, which takes no such argument; add "
                        "`curriculum_seqlen=None` to forward and truncate the sequences to it (see "
                        "docs/curriculum.md), or disable the section")


def truncate_sequence(value: Any, seqlen: int) -> Any:
    """`value` (a tensor or nested tuple/list of them) with every tensor of
    two or more dimensions sliced to `[:, :seqlen]` (a view, no copy); other
    values unchanged. See [Note: curriculum_seqlen]."""
    if isinstance(value, torch.Tensor):
        return value[:, :seqlen] if value.dim() >= 2 else value
    if isinstance(value, (tuple, list)):
        return type(value)(truncate_sequence(v, seqlen) for v in value)
    return value


def tokens_of(ids: torch.Tensor, curriculum_seqlen: Any) -> int:
    """Tokens a forward really processes from the token ids `ids` (shape
    [batch, seq, ...]): all of them, or with an integer `curriculum_seqlen`
    only the first `curriculum_seqlen` positions of each sequence."""
    if isinstance(curriculum_seqlen, int) and ids.dim() >= 2 and ids.shape[1] > 0:
        return ids.numel() // ids.shape[1] * min(ids.shape[1], curriculum_seqlen)
    return ids.numel()


class TokenStepLR:
    """An LR scheduler advanced by the tokens of each step instead of by one
    per step (config `curriculum_learning.lr_schedule_in_tokens`).

    A step at curriculum difficulty d (a sequence length) counts as
    d / max_difficulty of a full-length step, so the wrapped schedule's
    steps (warmup_num_steps, total_num_steps) count full-length steps'
    worth of tokens: Megatron's --lr-warmup-tokens and --lr-decay-tokens,
    divided by the tokens of one full-length step (train_batch_size x
    max_difficulty). The schedule is called with the fractional iteration
    (`step(last_batch_iteration)`), which dsrun's and DeepSpeed's schedules
    take; once the curriculum reached max_difficulty it advances by one per
    step as before.

    Args:
        scheduler: the wrapped schedule (step(last_batch_iteration),
            get_last_lr(), state_dict(), load_state_dict()).
        curriculum: the engine's legacy CurriculumScheduler.

    Other attributes (get_lr, optimizer, ...) are the wrapped schedule's.
    """

    def __init__(self, scheduler: Any, curriculum: CurriculumScheduler) -> None:
        self.scheduler = scheduler
        self.curriculum = curriculum
        self.full_steps = 0.0  # full-length steps' worth of tokens so far

    def step(self, last_batch_iteration: float | None = None) -> None:
        """Advance by the current difficulty's share of a full step (or to
        `last_batch_iteration` when given, as the wrapped schedule would)."""
        if last_batch_iteration is None:
            state = self.curriculum.state
            self.full_steps += state["current_difficulty"] / state["max_difficulty"]
            last_batch_iteration = self.full_steps - 1  # schedules start at -1: one step done is 0
        else:
            self.full_steps = last_batch_iteration + 1
        self.scheduler.step(last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """{"scheduler": the wrapped state, "full_steps"} (JSON data)."""
        return {"scheduler": self.scheduler.state_dict(), "full_steps": self.full_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.full_steps = float(state["full_steps"])

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "curriculum", "full_steps"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)
