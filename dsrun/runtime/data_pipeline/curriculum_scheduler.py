"""`CurriculumScheduler`: the difficulty of each optimizer step
(DeepSpeed's `deepspeed.runtime.data_pipeline.curriculum_scheduler`).

Li et al., "The Stability-Efficiency Dilemma: Investigating Sequence Length
Warmup for Training GPT Models" (NeurIPS 2022), and DeepSpeed's curriculum
learning tutorial. The difficulty is a number (a sequence length for the
seqlen curriculum, a metric value or percentile for the data sampler) that
grows with the optimizer step from `min_difficulty` to `max_difficulty`.

[Note: the fixed schedules]
For step s (DeepSpeed counts the step about to run: `global_steps + 1`),
with progress p = (s / total_curriculum_step) ** (1 / root_degree)
(root_degree 1 for fixed_linear):

    d = floor(p * (max_difficulty - min_difficulty) + min_difficulty)
    d = d - d % difficulty_step                       # rounded down to the step
    d = max(d, ceil(min_difficulty / difficulty_step) * difficulty_step)
    d = min(d, max_difficulty)

The third line is DeepSpeed 0.19.8's: without it a min_difficulty that is
not a multiple of difficulty_step (8 with step 16) floors to 0, a sequence
of no tokens. fixed_discrete returns difficulty[i] for the first i with
s <= max_step[i], and the last difficulty after the last max_step.
`update_difficulty` moves the current difficulty only while it is below
max_difficulty, as DeepSpeed's does (a custom schedule that goes past the
maximum stays there).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


class CurriculumScheduler:
    """The difficulty of each step under one schedule (see [Note: the fixed schedules]).

    Args:
        config: DeepSpeed's dict: "min_difficulty", "max_difficulty",
            "schedule_type" (fixed_linear, fixed_root, fixed_discrete,
            custom) and "schedule_config" ({"total_curriculum_step",
            "difficulty_step"} plus "root_degree" for fixed_root;
            {"difficulty": [...], "max_step": [...]} with one max_step less
            than difficulties for fixed_discrete; unused for custom). A
            pydantic config section (dsrun.runtime.config.sections
            `CurriculumScheduleConfig`) is accepted too.

    Raises:
        ValueError: a key is missing or a value does not fit the schedule
            type (the message names the key). The config sections check the
            same when a ds_config is loaded.

    The state (`state_dict()`) is JSON data: the config's values and
    "current_difficulty"; a custom schedule's function is not part of it
    (set it again after building a scheduler; loading a state keeps it).
    """

    def __init__(self, config: Any) -> None:
        if hasattr(config, "model_dump"):
            config = config.model_dump(mode="json")
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in config:
                raise ValueError(f"curriculum learning needs '{key}' in its config")
        kind = config["schedule_type"]
        if kind not in SCHEDULE_TYPES:
            raise ValueError(f"unknown curriculum schedule_type {kind!r}; use one of {', '.join(SCHEDULE_TYPES)}")
        schedule = dict(config.get("schedule_config") or {})
        _check_schedule(kind, schedule)
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": kind,
            "schedule_config": schedule,
        }
        self.custom_get_difficulty: Callable[[int], int] | None = None
        self.first_step = True  # DeepSpeed's attribute (its pipeline engine reads it)

    # -- DeepSpeed's methods ---------------------------------------------------------------
    def get_current_difficulty(self) -> int:
        """The difficulty the last `update_difficulty` set (min_difficulty before the first)."""
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        """Set the current difficulty (the schedule goes on from the next update)."""
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The function step -> difficulty of the "custom" schedule type."""
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        """DeepSpeed's name of `state_dict` (the live dict, as DeepSpeed returns)."""
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        """DeepSpeed's name of `load_state_dict`."""
        self.load_state_dict(state)

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at step `global_steps` (no state changes).

        Raises:
            RuntimeError: a custom schedule without its function
                (engine.set_custom_curriculum_learning_schedule).
        """
        kind, schedule = self.state["schedule_type"], self.state["schedule_config"]
        if kind == "fixed_discrete":
            return _discrete(global_steps, schedule["difficulty"], schedule["max_step"])
        if kind == "custom":
            if self.custom_get_difficulty is None:
                raise RuntimeError("curriculum schedule_type 'custom' has no schedule function; call "
                                   "engine.set_custom_curriculum_learning_schedule(fn) (fn: step -> "
                                   "difficulty) before training")
            return self.custom_get_difficulty(global_steps)
        degree = 1 if kind == "fixed_linear" else schedule["root_degree"]
        return fixed_root_difficulty(global_steps, self.state["min_difficulty"], self.state["max_difficulty"],
                                     schedule["total_curriculum_step"], schedule["difficulty_step"], degree)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to the difficulty of step `global_steps` unless max_difficulty
        was reached; returns the current difficulty."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A copy of the state (JSON data)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; the custom function, if set, is kept.

        Raises:
            ValueError: the state lacks a key of `state_dict()`'s.
        """
        missing = sorted({"min_difficulty", "max_difficulty", "current_difficulty", "schedule_type",
                          "schedule_config"} - set(state))
        if missing:
            raise ValueError(f"not a curriculum scheduler state: missing {missing}")
        self.state = copy.deepcopy(dict(state))


def fixed_root_difficulty(step: int, min_difficulty: int, max_difficulty: int, total_steps: int,
                          difficulty_step: int, root_degree: float) -> int:
    """The fixed_root (root_degree 1: fixed_linear) difficulty at `step`;
    see [Note: the fixed schedules]."""
    progress = (float(step) / total_steps) ** (1.0 / root_degree)
    difficulty = math.floor(progress * (max_difficulty - min_difficulty) + min_difficulty)
    difficulty -= difficulty % difficulty_step
    difficulty = max(difficulty, -(-min_difficulty // difficulty_step) * difficulty_step)
    return min(difficulty, max_difficulty)


def _discrete(step: int, difficulties: list, max_steps: list):
    for difficulty, last in zip(difficulties, max_steps):
        if step <= last:
            return difficulty
    return difficulties[-1]


def _check_schedule(kind: str, schedule: dict) -> None:
    """Raise ValueError naming the schedule_config key that is missing or wrong."""
    needed = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
              "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
              "fixed_discrete": ("difficulty", "max_step"), "custom": ()}[kind]
    for key in needed:
        if key not in schedule:
            raise ValueError(f"curriculum schedule_type {kind!r} needs schedule_config.{key}")
    if kind == "fixed_discrete":
        difficulty, max_step = schedule["difficulty"], schedule["max_step"]
        if not difficulty or len(difficulty) != len(max_step) + 1:
            raise ValueError(f"fixed_discrete needs one more difficulty than max_step (the last difficulty "
                             f"holds after the last max_step), got {len(difficulty)} difficulties and "
                             f"{len(max_step)} max_steps")
    elif kind != "custom":
        if schedule["total_curriculum_step"] < 1 or schedule["difficulty_step"] < 1:
            raise ValueError("schedule_config.total_curriculum_step and difficulty_step must be >= 1")
        if kind == "fixed_root" and schedule["root_degree"] <= 0:
            raise ValueError("schedule_config.root_degree must be > 0 (2: square root)")
