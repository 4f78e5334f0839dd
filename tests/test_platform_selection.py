"""Choosing the platform: the available one of highest priority, or the one TOKENMILL_PLATFORM names."""

from __future__ import annotations

import pytest

from tokenmill import PluginError
from tokenmill.platform import detect_platform
from tokenmill.plugins import get_plugin_manager


def _available() -> list[str]:
    return sorted(r.value.name for r in get_plugin_manager().collect("tokenmill_detect_platform"))


def test_forcing_an_available_platform_takes_it(monkeypatch):
    monkeypatch.setenv("TOKENMILL_PLATFORM", "cpu")
    assert detect_platform(get_plugin_manager()).name == "cpu"


@pytest.mark.parametrize("name", ["rocm", "nonesuch"])
def test_forcing_a_platform_that_cannot_run_here_names_those_that_can(monkeypatch, name):
    if name in _available():
        pytest.skip(f"{name} runs on this machine")
    monkeypatch.setenv("TOKENMILL_PLATFORM", name)
    with pytest.raises(PluginError, match=rf"TOKENMILL_PLATFORM='{name}'.*the ones that can: \[.*'cpu'"):
        detect_platform(get_plugin_manager())


def test_unforced_detection_takes_the_highest_priority(monkeypatch):
    monkeypatch.delenv("TOKENMILL_PLATFORM", raising=False)
    found = get_plugin_manager().collect("tokenmill_detect_platform")
    best = max((r.value for r in found), key=lambda spec: spec.priority)
    assert detect_platform(get_plugin_manager()).name == best.name
