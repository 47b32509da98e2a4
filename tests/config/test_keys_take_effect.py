"""Every ds_config key either takes effect or says that it does not.

DESIGN rule: a key that does nothing always warns. So each leaf key of
DsConfig must be one of:

  read       some module of dsrun/ outside the config package names the field: an
             attribute `.name` or a string constant "name" (getattr, dict
             keys), found with `ast`. The module must also name the field's
             section (`fp16`, `zero_optimization`, ...), so that a read of
             `fp16.enabled` does not count for `wandb.enabled`;
  no effect  listed in NO_EFFECT_YET (load_config warns when it is set to
             anything but what dsrun behaves as);
  rejected   every value it can take except its default is rejected by a
             NOT_YET_SUPPORTED entry on its path (probed for booleans,
             numbers and Literals);
  switched off  it only matters when its section's switch (`enabled` or
             `device`, or a switch named in ONLY_WITH) is on, and the switch
             is "rejected" as above -- in DeepSpeed too such a key does
             nothing while its section is off; when the feature lands and its
             entry is deleted, the key must be read or declared;
  allowed    in ALLOWED below, each with its reason.

A key that is none of these is accepted and silently ignored: the test
fails naming it. The fix is to make the runtime read it, or add it to
NO_EFFECT_YET with the value dsrun behaves as -- not to add it to ALLOWED.
"""
from __future__ import annotations

import ast
import typing
from pathlib import Path

import pydantic
import pytest
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

import dsrun
from dsrun.runtime import config as config_module
from dsrun.runtime.config import DsConfig

# Keys that pass although no rule above covers them. Keep this short.
ALLOWED: dict[str, str] = {}

# Keys that DeepSpeed only reads while another key (the switch) is on.
ONLY_WITH: dict[str, str] = {
    "zero_force_ds_cpu_optimizer": "zero_optimization.offload_optimizer.device",
    # DeepCompile's knobs (DeepSpeed's compile/config.py): read only under compile.deepcompile
    **{f"compile.{key}": "compile.deepcompile" for key in (
        "free_activation", "free_activation_threshold", "offload_activation", "offload_activation_pin_memory",
        "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
        "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
        "keep_int_input_tensors", "keep_all_input_tensors", "passes")},
}

_SWITCHES = ("enabled", "device")  # a section's own on/off key
_PROBES = (False, True, None, -1, 0, 1, 2, 0.5, 10**9)  # for bool, int, float and Literal fields
_DSRUN = Path(dsrun.__file__).parent
_CONFIG_DIR = Path(config_module.__file__).parent  # the schema names every field itself


def leaf_fields(model: type[BaseModel] = DsConfig,
                prefix: str = "") -> typing.Iterator[tuple[str, FieldInfo]]:
    """(dotted path, FieldInfo) of every leaf key, nested sections walked."""
    for name, field in model.model_fields.items():
        section = config_module._model_of(field)
        if section is not None:
            yield from leaf_fields(section, f"{prefix}{name}.")
        else:
            yield prefix + name, field


def names_per_module(root: Path = _DSRUN) -> list[set[str]]:
    """For each module under `root` outside the config package: its attribute names and string constants."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(_CONFIG_DIR):
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
        found.append(names)
    return found


def is_read(path: str, modules: list[set[str]]) -> bool:
    """Some module names the key's field, and its section's field when nested."""
    parts = path.split(".")
    wanted = {parts[-1], *parts[-2:-1]}
    return any(wanted <= names for names in modules)


def is_rejected(path: str, field: FieldInfo, unsupported) -> bool:
    """Every value the field accepts except its default is rejected by an entry on `path`.

    False when the field's values cannot be enumerated by the probes
    (strings, lists, paths).
    """
    base = config_module._unwrap(field.annotation)[0]
    if base not in (bool, int, float) and typing.get_origin(base) is not typing.Literal:
        return False
    annotation = field.annotation
    if field.metadata:  # constraints such as >= 1, kept apart from the annotation by pydantic
        annotation = typing.Annotated[(annotation, *field.metadata)]
    adapter = TypeAdapter(annotation)
    default = field.get_default(call_default_factory=True)
    probes = list(_PROBES) + list(typing.get_args(base))
    for probe in probes:
        try:
            value = adapter.validate_python(probe)
        except pydantic.ValidationError:
            continue  # not a value this key can take
        if value != default and not any(e.path == path and e.applies(value) for e in unsupported):
            return False
    return True


def unaccounted(model: type[BaseModel] = DsConfig, modules: list[set[str]] | None = None) -> list[str]:
    """Key paths of `model` that are accepted, read by nothing and not declared (see module docstring)."""
    modules = names_per_module() if modules is None else modules
    unsupported = config_module.registries.NOT_YET_SUPPORTED
    fields = dict(leaf_fields(model))

    def rejected(path: str) -> bool:
        return path in fields and is_rejected(path, fields[path], unsupported)

    def switched_off(path: str) -> bool:
        section, _, name = path.rpartition(".")
        switches = [f"{section}.{s}" if section else s for s in _SWITCHES if s != name]
        switches += [ONLY_WITH[path]] if path in ONLY_WITH else []
        return any(rejected(s) for s in switches)

    return [path for path in fields
            if not (is_read(path, modules) or path in config_module.NO_EFFECT_YET or rejected(path)
                    or switched_off(path) or path in ALLOWED)]


# ----------------------------------------------------------------------------- the real schema

def test_every_key_takes_effect_or_is_declared():
    offending = unaccounted()
    assert not offending, (
        f"{len(offending)} config key(s) are accepted but read by nothing in dsrun/ and declared "
        "nowhere; make the runtime read each one, or add it to NO_EFFECT_YET in "
        "dsrun/runtime/config/registries.py with the value dsrun behaves as:\n  " + "\n  ".join(offending))


def test_allowed_and_only_with_name_real_keys_that_need_them():
    keys = dict(leaf_fields())
    modules = names_per_module()
    for path in [*ALLOWED, *ONLY_WITH, *ONLY_WITH.values()]:
        assert path in keys, f"{path} is not a config key"
    for path in ALLOWED:  # an entry that became unnecessary goes away
        assert not is_read(path, modules) and path not in config_module.NO_EFFECT_YET, path


# ----------------------------------------------------------------------------- the detector can fail

def test_a_new_unread_key_is_reported():
    """A field added to the schema (top level and nested) that nothing reads is named."""
    section = pydantic.create_model("KnobSection", __base__=config_module._Section,
                                    enabled=(bool, False), zz_depth=(int, 3))
    fake = pydantic.create_model("FakeConfig", __base__=DsConfig, zz_unread_knob=(bool, False),
                                 zz_section=(section, pydantic.Field(default_factory=section)))
    new = [p for p in unaccounted(fake) if p not in unaccounted()]
    # `enabled` too: modules read `.enabled`, but none names zz_section
    assert new == ["zz_unread_knob", "zz_section.enabled", "zz_section.zz_depth"]


def test_declaring_or_reading_a_key_accounts_for_it(monkeypatch):
    fake = pydantic.create_model("FakeConfig", __base__=DsConfig, zz_unread_knob=(bool, False))
    assert "zz_unread_knob" in unaccounted(fake)
    assert "zz_unread_knob" not in unaccounted(fake, names_per_module() + [{"zz_unread_knob"}])
    monkeypatch.setitem(config_module.NO_EFFECT_YET, "zz_unread_knob", False)
    assert "zz_unread_knob" not in unaccounted(fake)
    monkeypatch.undo()
    monkeypatch.setattr(config_module.registries, "NOT_YET_SUPPORTED", (
        *config_module.NOT_YET_SUPPORTED, config_module.Unsupported("zz_unread_knob", bool, "a knob")))
    assert "zz_unread_knob" not in unaccounted(fake)


def test_a_key_whose_read_is_removed_is_reported():
    """Forgetting to read a key that takes effect today (a runtime without the name) is caught."""
    modules = [names - {"stage3_max_live_parameters"} for names in names_per_module()]
    assert "zero_optimization.stage3_max_live_parameters" in unaccounted(modules=modules)


def test_a_generic_name_read_for_another_section_does_not_count():
    """`enabled` read for fp16 does not make a `wandb.enabled` take effect."""
    assert not is_read("wandb.enabled", [{"fp16", "enabled"}, {"wandb", "group"}])
    assert is_read("wandb.enabled", [{"wandb", "enabled"}])


def test_when_a_feature_lands_its_keys_must_be_read_or_declared(monkeypatch):
    """A section whose switch is rejected passes unread; deleting the entry exposes the whole section."""
    section = pydantic.create_model("ZzSection", __base__=config_module._Section,
                                    enabled=(bool, False), zz_depth=(int, 3))
    fake = pydantic.create_model("FakeConfig", __base__=DsConfig,
                                 zz_feature=(section, pydantic.Field(default_factory=section)))
    keys = {"zz_feature.enabled", "zz_feature.zz_depth"}
    monkeypatch.setattr(config_module.registries, "NOT_YET_SUPPORTED", (
        *config_module.NOT_YET_SUPPORTED, config_module.Unsupported("zz_feature.enabled", bool, "a feature")))
    assert not keys & set(unaccounted(fake))
    monkeypatch.undo()
    assert keys <= set(unaccounted(fake))


@pytest.mark.parametrize("path, rejected", [
    ("fp16.fp16_master_weights_and_grads", True),         # bool, true rejected
    ("zero_optimization.zero_hpz_partition_size", False),  # >= 1, every value accepted (hpZ landed)
    ("gradient_predivide_factor", False),                 # > 0, every value accepted (landed)
    ("zero_optimization.offload_param.device", False),    # Literal, every value accepted (offload landed)
    ("zero_optimization.mics_shard_size", False),         # 0 is accepted and not rejected
    ("optimizer.type", False),                            # a string: no type is rejected
])
def test_rejected_means_every_other_value_is_rejected(path, rejected):
    field = dict(leaf_fields())[path]
    assert is_rejected(path, field, config_module.NOT_YET_SUPPORTED) is rejected


def test_a_no_effect_key_warns_only_when_set_to_something_else(recwarn):
    """The keys this test made declare themselves: e.g. ignore_unused_parameters."""
    def load(value):
        config_module.load_config({"train_micro_batch_size_per_gpu": 1,
                                   "zero_optimization": {"ignore_unused_parameters": value}}, world_size=1)

    load(True)  # what dsrun does: quiet
    assert not [w for w in recwarn if issubclass(w.category, config_module.ConfigWarning)]
    load(False)
    (warning,) = [w for w in recwarn if issubclass(w.category, config_module.ConfigWarning)]
    assert "zero_optimization.ignore_unused_parameters=false" in str(warning.message)
