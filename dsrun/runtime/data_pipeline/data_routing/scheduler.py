"""How many tokens random-LTD's layers keep at each optimizer step.

Random-LTD (Yao et al., "Random-LTD: Random and Layerwise Token Dropping
Brings Efficient Training for Large-scale Transformers", 2022, §3.2 and
Fig. 2) starts with short kept sequences and lengthens them linearly until
the layers see every token ("monotonic sequence length growth"); DeepSpeed
Data Efficiency (Li et al., AAAI 2024) is the same ramp. The engine calls
`update_seq(global_steps)` after every optimizer step (and once at start-up);
the dropping layers read `get_current_seq()`.
"""
from __future__ import annotations

import math
from typing import Any

from dsrun.runtime.data_pipeline.data_routing.config import RandomLTDConfig

# The state a checkpoint keeps (DeepSpeed's keys).
_SAVED_KEYS = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")


def fixed_linear_value(step: int, min_value: int, max_value: int, require_steps: int, seq_per_step: int) -> int:
    """The kept-token count at optimizer step `step` (DeepSpeed's formula).

    `floor(step / require_steps * (max_value - min_value) + min_value)`,
    rounded down to a multiple of `seq_per_step`, capped at `max_value`.
    The rounding applies to the count itself, not to its distance from
    min_value, so a min_value that is not a multiple of seq_per_step starts
    below itself (as in DeepSpeed); and when max_value is not a multiple,
    the count reaches it only once the unrounded ramp passes the next
    multiple (after require_steps).

    Args:
        step: optimizer steps taken (0-based), >= 0.
        min_value, max_value: tokens kept at step 0 and at the end.
        require_steps: steps of the ramp, >= 1.
        seq_per_step: granularity of the count, >= 1.

    Returns:
        Tokens kept per sample in each dropping layer.
    """
    value = math.floor(float(step) / require_steps * (max_value - min_value) + min_value)
    value -= value % seq_per_step
    return min(value, max_value)


class RandomLTDScheduler:
    """The kept-token schedule and the layer-token count (DeepSpeed's `RandomLTDScheduler`).

    Args:
        random_ltd: an enabled `random_ltd` section.
        global_batch_size: samples per optimizer step over all ranks (for
            the layer-token count).

    Attributes:
        state: DeepSpeed's state dict: "min_value", "max_value",
            "current_value" (tokens kept now), "schedule_config",
            "schedule_type", "consumed_layer_tokens" (sum over steps of
            samples x tokens each layer processed), "current_steps" (the
            step last counted; -1 before the first).
        random_ltd_layer_num, model_layer_num: dropping and total layers.
        random_ltd: the section it was built from (the dropping layers
            read model_type, hidden_state_order and model_mask_name from it).
    """

    def __init__(self, random_ltd: RandomLTDConfig, global_batch_size: int) -> None:
        if random_ltd.random_ltd_schedule is None:
            raise ValueError("random_ltd has no random_ltd_schedule; load the config through "
                             "dsrun.runtime.config.load_config with random_ltd.enabled true")
        self.random_ltd = random_ltd
        self.model_layer_num = random_ltd.total_layer_num
        self.random_ltd_layer_num = random_ltd.random_ltd_layer_num
        self.global_batch_size = global_batch_size
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        """Back to step 0: current_value = min_value, nothing consumed."""
        schedule = self.random_ltd.random_ltd_schedule
        self.state.update(min_value=schedule.min_value, max_value=schedule.max_value,
                          current_value=schedule.min_value,
                          schedule_config=schedule.schedule_config.model_dump(),
                          schedule_type=schedule.schedule_type, consumed_layer_tokens=0, current_steps=-1)

    def get_value(self, global_steps: int) -> int:
        """The kept-token count the schedule gives at `global_steps` (see `fixed_linear_value`)."""
        settings = self.state["schedule_config"]
        return fixed_linear_value(global_steps, self.state["min_value"], self.state["max_value"],
                                  settings["require_steps"], settings["seq_per_step"])

    def update_seq(self, global_steps: int) -> None:
        """Set the kept-token count for step `global_steps` and count the step's layer-tokens.

        The count only grows: once at max_value it stays there. Each step
        is counted once however often this is called with it:
        global batch x (kept x dropping layers + max_value x other layers).
        """
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            other_layers = self.model_layer_num - self.random_ltd_layer_num
            self.state["consumed_layer_tokens"] += self.global_batch_size * (
                self.state["current_value"] * self.random_ltd_layer_num + self.state["max_value"] * other_layers)
            self.state["current_steps"] = global_steps

    def get_current_seq(self) -> int:
        """Tokens each dropping layer keeps now (per sample)."""
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        """Override the kept-token count until the next `update_seq`."""
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        """How many layers drop tokens."""
        return self.random_ltd_layer_num

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens a run of `train_iters` optimizer steps consumes from
        step 0 (for sizing a run). Unlike DeepSpeed's method of the same
        name this leaves the scheduler's own state untouched."""
        fresh = RandomLTDScheduler(self.random_ltd, self.global_batch_size)
        for step in range(train_iters):
            fresh.update_seq(step)
        return fresh.state["consumed_layer_tokens"]

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps (DeepSpeed's keys; JSON-ready ints)."""
        return {key: int(self.state[key]) for key in _SAVED_KEYS}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore a `state_dict()`; the schedule continues from its step.

        Raises:
            KeyError: a key of `state_dict()` is missing.
        """
        for key in _SAVED_KEYS:
            self.state[key] = state_dict[key]
