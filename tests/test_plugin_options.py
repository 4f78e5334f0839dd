"""Options plugins add (tokenmill_add_options), through the Python API, with the installed
tokenmill-example-toy plugin: it adds ``toy.greeting`` and logs it when an engine process starts."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.options import plugin_option_specs, resolve_plugin_options

TINY = {"max_model_len": 64, "kv_cache_memory": "8MiB"}


@pytest.fixture(scope="module")
def toy_specs():
    manager = PluginManager(allow=frozenset({"toy"}))
    manager.load_entry_points()
    return plugin_option_specs(manager)


def test_the_toy_plugin_adds_a_namespaced_option(toy_specs):
    spec = toy_specs["toy.greeting"]
    assert (spec.type, spec.default) == (str, "hello") and "logs" in spec.help


def test_resolving_fills_defaults_and_checks_types(toy_specs):
    assert resolve_plugin_options({}, toy_specs) == {"toy.greeting": "hello"}
    assert resolve_plugin_options({"toy.greeting": "hi"}, toy_specs) == {"toy.greeting": "hi"}
    with pytest.raises(ConfigError, match=r"toy\.greeting: Input should be a valid string"):
        resolve_plugin_options({"toy.greeting": 5}, toy_specs)


def test_a_key_without_plugin_and_name_is_refused_by_the_config():
    with pytest.raises(ValidationError, match=r"<plugin>\.<name>"):
        EngineConfig(plugin_options={"greeting": "hi"})


def test_the_option_reaches_the_plugin_in_the_engine_process(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill_example_toy"):
        LLM(str(llama_path), plugin_options={"toy.greeting": "bonjour"}, **TINY)
    assert "toy plugin: bonjour from the engine process" in caplog.text


def test_an_unknown_plugin_option_stops_the_engine_naming_it(llama_path):
    with pytest.raises(ConfigError, match=r"toy\.greting.*toy\.greeting"):
        LLM(str(llama_path), plugin_options={"toy.greting": "hi"}, **TINY)
