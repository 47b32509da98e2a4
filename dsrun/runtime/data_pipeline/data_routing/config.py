"""The `data_routing` section of `data_efficiency`: random-LTD's settings.

    "data_efficiency": {"enabled": true, "data_routing": {"enabled": true,
        "random_ltd": {"enabled": true, "total_layer_num": 24, "random_ltd_layer_num": 22,
                       "random_ltd_layer_id": [1, ..., 22], "model_mask_name": "attention_mask",
                       "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
                       "random_ltd_schedule": {"min_value": 128, "max_value": 2048,
                           "schedule_type": "fixed_linear",
                           "schedule_config": {"require_steps": 200000, "seq_per_step": 16}}}}}

Key names and meanings are DeepSpeed's (`deepspeed/runtime/data_pipeline/
constants.py`); the checks across keys (layer ids in range and as many as
`random_ltd_layer_num`, min <= max) are dsrun's, made when the config is
loaded instead of when the first dropping layer runs.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dsrun.runtime.config.errors import _Problem
from dsrun.runtime.config.sections import Count, PosInt, _Section


class RandomLTDScheduleSettings(_Section):
    """`schedule_config` of `random_ltd_schedule`: the pace of the fixed-linear ramp."""

    require_steps: PosInt = Field(description="Optimizer steps from min_value to max_value kept tokens.")
    seq_per_step: PosInt = Field(description="Granularity of the kept-token count: it is rounded down to a "
                                             "multiple of this (8 or 16 suits tensor cores).")


class RandomLTDSchedule(_Section):
    """`random_ltd_schedule`: how many tokens each dropping layer keeps per step."""

    min_value: PosInt = Field(description="Tokens kept at step 0 (per sample, per dropping layer).")
    max_value: PosInt = Field(description="Tokens kept at the end of the ramp: normally the full sequence "
                                          "length, where the layers stop dropping.")
    schedule_type: Literal["fixed_linear"] = Field(
        "fixed_linear", description="Ramp shape; DeepSpeed implements only fixed_linear for random-LTD.")
    schedule_config: RandomLTDScheduleSettings = Field(description="require_steps and seq_per_step.")

    @model_validator(mode="after")
    def _ordered(self) -> RandomLTDSchedule:
        if self.min_value > self.max_value:
            raise _Problem(f"min_value ({self.min_value}) is above max_value ({self.max_value}); the schedule "
                           "raises the kept-token count from min_value to max_value", key="min_value")
        return self


class LayerTokenLRSchedule(_Section):
    """`layer_token_lr_schedule`: a learning rate driven by layer-tokens consumed.

    DeepSpeed raises NotImplementedError when it is enabled; dsrun rejects
    it at load time (dsrun.runtime.config.registries.NOT_YET_SUPPORTED), and
    the keys are accepted so that DeepSpeed's example configs, which list
    them with `"enabled": false`, load."""

    enabled: bool = Field(False, description="Must stay false: not implemented (nor in DeepSpeed).")
    total_layer_tokens: Optional[Count] = Field(None, description="Layer-tokens of the whole run (unused).")
    warmup_type: Optional[str] = Field(None, description="Warm-up shape (unused).")
    warmup_layer_tokens: Optional[Count] = Field(None, description="Layer-tokens of warm-up (unused).")


class RandomLTDConfig(_Section):
    """`random_ltd`: which layers drop tokens, and how many they keep.

    With `enabled` true every key but `model_mask_name` and
    `layer_token_lr_schedule` is required. Layers are numbered from 0 in
    the order `convert_to_random_ltd` finds them (the model's module order).
    """

    enabled: bool = Field(False, description="Drop tokens in the listed layers while training.")
    total_layer_num: Optional[PosInt] = Field(None, description="Layers of the class given to "
                                              "convert_to_random_ltd in the model (checked against it).")
    random_ltd_layer_num: Optional[PosInt] = Field(None, description="How many layers drop tokens: the "
                                                   "length of random_ltd_layer_id.")
    random_ltd_layer_id: Optional[list[Count]] = Field(None, description="Which layers drop tokens, "
                                                       "0-based, each below total_layer_num.")
    model_mask_name: Optional[str] = Field(None, description="Keyword argument of the layer's forward that "
                                           "holds the attention mask (sliced to the kept tokens); null: "
                                           "the layer takes no mask (e.g. it applies a causal mask itself).")
    model_type: Optional[Literal["decoder", "encoder"]] = Field(
        None, description="decoder: a causal mask, sliced to the first kept x kept entries (the kept "
                          "tokens stay in order); encoder: the mask's rows and columns of the kept tokens.")
    hidden_state_order: Optional[Literal["batch_seq_dim", "seq_batch_dim"]] = Field(
        None, description="Layout of the layer's first input: (batch, seq, hidden) or (seq, batch, hidden).")
    random_ltd_schedule: Optional[RandomLTDSchedule] = Field(None, description="The kept-token schedule.")
    layer_token_lr_schedule: LayerTokenLRSchedule = Field(default_factory=LayerTokenLRSchedule,
                                                          description="Not implemented; must be disabled.")

    @model_validator(mode="after")
    def _complete(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        required = ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_type",
                    "hidden_state_order", "random_ltd_schedule")
        missing = [name for name in required if getattr(self, name) is None]
        if missing:
            raise _Problem(f"random_ltd is enabled but {', '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not set; give every one of {', '.join(required)}")
        ids = self.random_ltd_layer_id
        outside = [i for i in ids if i >= self.total_layer_num]
        if outside:
            raise _Problem(f"layer ids {outside} are out of range: the model has total_layer_num="
                           f"{self.total_layer_num} layers, numbered 0 to {self.total_layer_num - 1}",
                           key="random_ltd_layer_id")
        if len(set(ids)) != len(ids):
            raise _Problem(f"{ids} lists a layer more than once; list each dropping layer once",
                           key="random_ltd_layer_id")
        if len(ids) != self.random_ltd_layer_num:
            raise _Problem(f"random_ltd_layer_num is {self.random_ltd_layer_num} but random_ltd_layer_id lists "
                           f"{len(ids)} layers; make them agree", key="random_ltd_layer_num")
        return self


class DataRoutingConfig(_Section):
    """`data_efficiency.data_routing`: per-layer token routing (random-LTD)."""

    enabled: bool = Field(False, description="Turn data routing on (random_ltd.enabled must be true too).")
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig,
                                        description="Random layerwise token dropping.")
