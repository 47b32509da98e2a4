"""Tests of the ds_config schema (dsrun/runtime/config/).

Each bad config asserts the exact content of its message: the key path,
the suggestion, the numbers. Good configs check file formats, aliases,
batch-triple inference and defaults.
"""
import json

import pytest

from dsrun.runtime import config as config_module
from dsrun.runtime.config import ConfigError, DsConfig, Unsupported, load_config

MICRO = {"train_micro_batch_size_per_gpu": 4}


def problems(source, world_size=1):
    """The list of problem lines load_config reports for `source`."""
    with pytest.raises(ConfigError) as info:
        load_config(source, world_size=world_size)
    text = str(info.value)
    # pydantic's own dump must never reach the user
    assert "pydantic" not in text and "validation error" not in text.lower()
    assert text.count("\n  - ") == len(info.value.problems)
    return info.value.problems


@pytest.fixture
def all_features(monkeypatch):
    """Pretend every feature is built, to test values the registry would reject."""
    monkeypatch.setattr(config_module.registries, "NOT_YET_SUPPORTED", ())


# --------------------------------------------------------------------- bad configs

def test_unknown_nested_key_names_path_and_closest_key():
    got = problems({**MICRO, "zero_optimization": {"stage3_prefetch_bucket_sze": 5}})
    assert got == ["zero_optimization.stage3_prefetch_bucket_sze: unknown key 'stage3_prefetch_bucket_sze' "
                   "in zero_optimization; did you mean 'stage3_prefetch_bucket_size'?"]


def test_top_level_typo():
    got = problems({**MICRO, "gradient_clpping": 1.0})
    assert got == ["gradient_clpping: unknown key 'gradient_clpping' at the top level; "
                   "did you mean 'gradient_clipping'?"]


def test_unknown_key_without_close_match_lists_valid_keys(monkeypatch):
    monkeypatch.setenv("DSRUN_STRICT_CONFIG", "1")  # otherwise it only warns (tests/compat)
    (got,) = problems({**MICRO, "bf16": {"zzz": 1}})
    assert got == "bf16.zzz: unknown key 'zzz' in bf16; valid keys: enabled"


def test_deepspeed_section_not_implemented():
    (got,) = problems({**MICRO, "hybrid_engine": {"enabled": True}})
    assert got.startswith("hybrid_engine: the hybrid engine is a DeepSpeed feature that dsrun does not implement")


def test_wrong_type():
    (got,) = problems({**MICRO, "zero_optimization": {"stage": "two"}})
    assert got == "zero_optimization.stage: expected an integer 0-3, got 'two'"


def test_bool_is_not_a_number_and_section_must_be_object():
    got = problems({"train_micro_batch_size_per_gpu": True, "fp16": True})
    assert "train_micro_batch_size_per_gpu: expected a positive integer or null, got True" in got
    assert any(p.startswith("fp16: expected an object with keys such as enabled") for p in got)


def test_out_of_range_values():
    got = problems({**MICRO, "zero_optimization": {"stage": 4}, "fp16": {"loss_scale": -1},
                    "gradient_clipping": -0.5, "steps_per_print": 0})
    assert "zero_optimization.stage: expected an integer 0-3, got 4" in got
    assert "fp16.loss_scale: expected a number >= 0, got -1" in got
    assert "gradient_clipping: expected a number >= 0, got -0.5" in got
    assert "steps_per_print: expected a positive integer, got 0" in got


def test_bad_enum_value():
    (got,) = problems({**MICRO, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    assert got == ("zero_optimization.offload_optimizer.device: expected one of 'none', 'cpu', 'nvme', "
                   "got 'gpu'")


def test_list_item_type():
    (got,) = problems({**MICRO, "comms_logger": {"prof_ops": ["all_reduce", 3]}})
    assert got == "comms_logger.prof_ops[1]: expected a string, got 3"


def test_inconsistent_batch_triple_shows_arithmetic_and_fixes():
    (got,) = problems({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 2}, world_size=2)
    assert got == ("train_batch_size=32 but 4 (train_micro_batch_size_per_gpu) x 2 "
                   "(gradient_accumulation_steps) x 2 (world size) = 16; set train_batch_size to 16, "
                   "gradient_accumulation_steps to 4 or train_micro_batch_size_per_gpu to 8")


def test_missing_batch_size():
    (got,) = problems({"gradient_accumulation_steps": 2})
    assert "neither train_batch_size nor train_micro_batch_size_per_gpu is set" in got


def test_non_divisible_inference():
    (got,) = problems({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert got == ("train_batch_size=30 is not divisible by 4 (train_micro_batch_size_per_gpu) x 2 "
                   "(world size) = 8, so gradient_accumulation_steps cannot be inferred; "
                   "set train_batch_size to a multiple of 8")
    (got,) = problems({"train_batch_size": 7}, world_size=2)
    assert "train_batch_size=7 is not divisible by 1 (gradient_accumulation_steps) x 2 (world size) = 2" in got


def test_auto_values_are_errors_everywhere():
    got = problems({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999]}}})
    assert len(got) == 3  # no extra "missing batch size" caused by the removed placeholders
    for path in ("train_batch_size", "train_micro_batch_size_per_gpu", "optimizer.params.lr"):
        assert f'{path}: "auto" is a placeholder that the Hugging Face Trainer integration fills in; ' \
               f"when calling dsrun directly, replace it with a value" in got


def test_fp16_and_bf16_together():
    (got,) = problems({**MICRO, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert got.startswith("bf16: fp16 and bf16 are both enabled; enable at most one of them")


def test_unsupported_features_are_each_named(monkeypatch):
    # A registry of our own: the real one shrinks as features land.
    monkeypatch.setattr(config_module.registries, "NOT_YET_SUPPORTED", (
        Unsupported("zero_optimization.stage", lambda v: v > 0, "ZeRO stages 1-3", "set it to 0"),
        Unsupported("bf16.enabled", bool, "bf16 mixed precision"),
        Unsupported("optimizer.type", lambda v: v == "Lamb", "the Lamb optimizer", "use Adam or AdamW"),
        Unsupported("scheduler.type", lambda v: True, "schedules"),  # scheduler absent: not applied
    ))
    got = problems({**MICRO, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                    "optimizer": {"type": "lamb"}})
    assert got == [
        "zero_optimization.stage=2: dsrun 0.1 does not support ZeRO stages 1-3 yet; remove it or set it to 0",
        "bf16.enabled=true: dsrun 0.1 does not support bf16 mixed precision yet; remove it or set it to false",
        "optimizer.type=\"Lamb\": dsrun 0.1 does not support the Lamb optimizer yet; remove it or use Adam "
        "or AdamW",
    ]


def test_real_registry_entries_name_real_keys():
    for entry in config_module.NOT_YET_SUPPORTED:
        model = DsConfig
        for part in entry.path.split("."):
            assert model is not None and part in model.model_fields, f"{entry.path} is not a config key"
            model = config_module._model_of(model.model_fields[part])
    # Lamb and the 1-bit optimizers are dsrun's own now: accepted
    assert not any(e.applies(name) for name in ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
                   for e in config_module.NOT_YET_SUPPORTED if e.path == "optimizer.type")


def test_no_effect_registry_names_real_keys():
    for path in config_module.NO_EFFECT_YET:
        model = DsConfig
        for part in path.split("."):
            assert model is not None and part in model.model_fields, f"{path} is not a config key"
            model = config_module._model_of(model.model_fields[part])


def test_settings_without_effect_warn_by_name(recwarn):
    cfg = load_config({**MICRO, "activation_checkpointing": {"number_checkpoints": 4},
                       "zero_optimization": {"stage": 2, "sub_group_size": 1000, "overlap_comm": False}},
                      world_size=1)
    (warning,) = [w for w in recwarn if issubclass(w.category, config_module.ConfigWarning)]
    text = str(warning.message)
    for key in ("zero_optimization.overlap_comm=false",
                "activation_checkpointing.number_checkpoints=4"):
        assert key in text
    assert "sub_group_size" not in text  # it takes effect (the fused optimizer step's chunks)
    assert "does not act on" in text
    assert cfg.zero_optimization.sub_group_size == 1000


def test_settings_with_effect_or_dsruns_behaviour_do_not_warn(recwarn):
    load_config({**MICRO, "wall_clock_breakdown": False,
                 "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "overlap_comm": True,
                                       "contiguous_gradients": True}}, world_size=1)
    assert not [w for w in recwarn if issubclass(w.category, config_module.ConfigWarning)]


def test_nvme_without_path(all_features):
    (got,) = problems({**MICRO, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert got == ("zero_optimization.offload_param.nvme_path: required when device is 'nvme'; "
                   "set it to a directory on a fast local drive")


def test_offload_param_needs_stage_3(all_features):
    (got,) = problems({**MICRO, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert got.startswith("zero_optimization.offload_param: offloading parameters needs stage 3 (stage is 2)")


def test_unknown_optimizer_and_scheduler_suggest_closest():
    got = problems({**MICRO, "optimizer": {"type": "Adamm"}, "scheduler": {"type": "warmupcosine"}})
    assert got[0].startswith("optimizer.type: unknown optimizer type 'Adamm'; did you mean 'Adam'? known: ")
    assert got[1].startswith("scheduler.type: unknown scheduler type 'warmupcosine'; "
                             "did you mean 'WarmupCosineLR'?")


def test_old_and_new_name_together():
    (got,) = problems({**MICRO, "aio": {"thread_count": 2, "intra_op_parallelism": 1}})
    assert got == ("aio.thread_count: both 'thread_count' and 'intra_op_parallelism' are given; "
                   "'thread_count' is the old name of 'intra_op_parallelism', keep only 'intra_op_parallelism'")


def test_all_problems_collected_one_per_line():
    got = problems({"gradient_accumulation_steps": 2, "train_batch_sise": 8,
                    "zero_optimization": {"stage": "two"}, "scheduler": {"type": "WarmupLR", "params": {
                        "warmup_max_lr": "auto"}}})
    assert len(got) == 4
    assert got[0].startswith('scheduler.params.warmup_max_lr: "auto"')
    assert any(p.startswith("zero_optimization.stage: expected") for p in got)
    assert any(p.startswith("train_batch_sise: unknown key") for p in got)
    assert any("neither train_batch_size nor" in p for p in got)


def test_bad_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert info.value.problems[0].startswith("not valid JSON at line 3, column 28: ")


def test_duplicate_json_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert problems(path) == ["not valid JSON: duplicate key 'train_batch_size'"]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.json")
    assert f"invalid dsrun config ({tmp_path / 'nope.json'})" in str(info.value)
    assert "config file does not exist" in str(info.value)


def test_bad_yaml_file_names_line(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 8\nfp16:\n  enabled: [true\n")
    (got,) = problems(path)
    assert got.startswith("not valid YAML at line 4, column 1: ")
    path.write_text("train_batch_size: 8\nfp16: {}\ntrain_batch_size: 16\n")
    (got,) = problems(path)
    assert got == "not valid YAML at line 3, column 1: duplicate key 'train_batch_size'"


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    assert problems(path) == ["the config must be a JSON object / YAML mapping at the top level, got list"]


def test_bad_world_size(monkeypatch):
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        load_config(MICRO, world_size=0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not a positive integer"):
        load_config(MICRO)


# --------------------------------------------------------------------- good configs

GOOD = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "adamw", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8},
    "aio": {"block_size": 1048576},
}

GOOD_YAML = """\
train_batch_size: 16
gradient_accumulation_steps: 2
gradient_clipping: 0.5
optimizer:
  type: adamw
  params: {lr: 1e-3, weight_decay: 0.01}
scheduler:
  type: WarmupLR
  params: {warmup_num_steps: 100}
zero_optimization:
  stage: 0
  reduce_bucket_size: 5e8
  allgather_bucket_size: 2e8
aio: {block_size: 1048576}
"""


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", "dict", "DsConfig"])
def test_json_yaml_dict_equivalence(tmp_path, suffix):
    if suffix == "dict":
        source = GOOD
    elif suffix == "DsConfig":
        source = load_config(GOOD, world_size=2)
    else:
        source = tmp_path / f"ds{suffix}"
        source.write_text(json.dumps(GOOD) if suffix == ".json" else GOOD_YAML)
    cfg = load_config(source, world_size=2)
    assert cfg.model_dump() == load_config(GOOD, world_size=2).model_dump()
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 1e-3
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


@pytest.mark.parametrize("given, world_size, expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2, (16, 4, 2)),   # gas inferred
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),      # micro inferred
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),  # tbs
    ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),                           # gas defaults to 1
    ({"train_batch_size": 8}, 4, (8, 2, 1)),                                          # only tbs
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),                              # consistent triple
])
def test_batch_triple_inference(given, world_size, expected):
    cfg = load_config(given, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_reloading_a_config_for_another_world_size():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, world_size=2)
    assert cfg.train_batch_size == 12
    assert load_config(cfg, world_size=4).train_batch_size == 24  # re-inferred, not a stale 12


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert load_config(MICRO).train_batch_size == 12


@pytest.mark.filterwarnings("ignore::dsrun.runtime.config.ConfigWarning")  # the old key names a no-effect setting
def test_aliases(all_features):
    cfg = load_config({**MICRO, "bfloat16": {"enabled": True}, "aio": {"thread_count": 4},
                       "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                             "cpu_offload_use_pin_memory": True,
                                             "stage3_gather_fp16_weights_on_model_save": True,
                                             "prefetch_bucket_size": 1e6}})
    zero = cfg.zero_optimization
    assert cfg.bf16.enabled and cfg.aio.intra_op_parallelism == 4
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory
    assert zero.stage3_gather_16bit_weights_on_model_save and zero.stage3_prefetch_bucket_size == 1_000_000


def test_defaults_are_deepspeeds(all_features):
    cfg = load_config(MICRO)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10 and not cfg.wall_clock_breakdown
    assert cfg.optimizer is None and cfg.scheduler is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
            fp16.consecutive_hysteresis, fp16.min_loss_scale) == (False, 0.0, 16, 1000, 2, False, 1.0)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.contiguous_gradients, zero.reduce_scatter) == (0, False, True, True)
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (50_000_000, 100_000)
    assert zero.sub_group_size == zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.offload_optimizer.device == zero.offload_param.device == "none"
    assert zero.offload_optimizer.buffer_count == 4 and zero.offload_param.buffer_count == 5
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism) == (1048576, 8, 1)
    assert cfg.data_types.grad_accum_dtype is None and cfg.comms_logger.prof_all
    assert load_config({**MICRO, "zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert "0.0 up to v0.16" in DsConfig.model_fields["gradient_clipping"].description


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            sub = config_module._model_of(field)
            if sub is not None:
                walk(sub)
    walk(DsConfig)


def test_summary_shows_arithmetic_and_given_keys():
    text = load_config(GOOD, world_size=2).summary()
    assert "batch: 16 = 4 (micro) x 2 (gas) x 2 (world size)" in text
    assert "* gradient_clipping" in text and "* zero_optimization.reduce_bucket_size" in text
    assert "train_micro_batch_size_per_gpu" not in text  # inferred, not given
    full = load_config(GOOD, world_size=2).summary(all_keys=True)
    assert "  zero_optimization.offload_param.max_in_cpu" in full and "(* = set in the config)" in full


def test_registry_is_one_line_per_feature(monkeypatch):
    kept = tuple(e for e in config_module.NOT_YET_SUPPORTED if e.path != "zero_optimization.stage")
    monkeypatch.setattr(config_module.registries, "NOT_YET_SUPPORTED", kept)
    assert load_config({**MICRO, "zero_optimization": {"stage": 2}}).zero_optimization.stage == 2


def test_reloading_keeps_changes_made_after_loading():
    cfg = load_config(MICRO)
    cfg.gradient_clipping = 0.0
    assert load_config(cfg).gradient_clipping == 0.0
    cfg.zero_optimization.stage = "x"  # assignment is not validated; loading again is
    assert problems(cfg) == ["zero_optimization.stage: expected an integer 0-3, got 'x'"]


def test_config_error_survives_pickling():
    import pickle
    err = pickle.loads(pickle.dumps(ConfigError("a: bad", "b: worse", source="ds.json")))
    assert err.problems == ["a: bad", "b: worse"] and err.source == "ds.json"
    assert str(err) == "invalid dsrun config (ds.json): 2 problems\n  - a: bad\n  - b: worse"


def test_config_error_with_one_message_reads_as_that_message():
    err = ConfigError("optimizer.params.lr: must be > 0, got -1")
    assert str(err) == "optimizer.params.lr: must be > 0, got -1" and err.problems == [str(err)]
    with pytest.raises(ConfigError, match="a config must be a dict, a file path or a DsConfig, got int"):
        load_config(3)


@pytest.mark.filterwarnings("error::dsrun.runtime.config.ConfigWarning")
def test_a_deepspeed_examples_config_loads():
    # DeepSpeedExamples' CIFAR config, as users copy it (stage lowered to 0):
    # it loads, and quietly, since every setting in it matches what dsrun does.
    cfg = load_config({
        "train_batch_size": 16, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.zero_optimization.overlap_comm is True
    assert cfg.scheduler.type == "WarmupLR" and cfg.fp16.loss_scale_window == 500
