"""Every config of tests/compat/configs/ loads, or fails, as configs/expected.json says."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsrun.runtime.config import ConfigError, ConfigWarning, load_config

CONFIGS = Path(__file__).parent / "configs"
EXPECTED = {k: v for k, v in json.loads((CONFIGS / "expected.json").read_text()).items() if not k.startswith("_")}


def test_every_config_has_an_expectation():
    assert sorted(p.name for p in CONFIGS.glob("*.json") if p.name != "expected.json") == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_outcome(name, monkeypatch):
    monkeypatch.delenv("DSRUN_STRICT_CONFIG", raising=False)
    expected = EXPECTED[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if expected["outcome"] == "loads":
            load_config(CONFIGS / name, world_size=2)
        else:
            with pytest.raises(ConfigError) as info:
                load_config(CONFIGS / name, world_size=2)
    if expected["outcome"] == "error":
        problems = info.value.problems
        assert len(problems) == len(expected["problems"]), problems
        for text in expected["problems"]:
            assert any(text in p for p in problems), (text, problems)
        return
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(messages) == len(expected["warns"]), messages
    for text in expected["warns"]:
        assert any(text in m for m in messages), (text, messages)
