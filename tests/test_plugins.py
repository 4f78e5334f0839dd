"""The plugin system with real installed distributions."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import EntryPoint, entry_points

import pytest
from tiny_models import hf_greedy
from worker_probe import on_rank_zero

from tokenmill import LLM, PluginError, SamplingParams, UnsupportedModelError
from tokenmill.hookspecs import ExperimentalHookWarning, _experimental, hookimpl, hookspec, is_experimental
from tokenmill.plugins.manager import ENTRY_POINT_GROUP, PluginInfo, PluginManager


def _installed(name: str) -> EntryPoint:
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    assert found, f"plugin {name!r} is not installed: run scripts/install --dev"
    return found[0]


@pytest.fixture(scope="module")
def toy_checkpoint(model_factory, tmp_path_factory):
    """A Llama checkpoint relabelled as the third-party ToyLM architecture."""
    folder = tmp_path_factory.mktemp("toy")
    shutil.copytree(model_factory("llama"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["ToyLMForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _model_module(worker) -> str:
    return type(worker.runner.model).__module__


def test_third_party_model_plugin_generates_like_transformers(toy_checkpoint, model_factory):
    ep = _installed("toy")
    assert ep.dist is not None and ep.dist.name == "tokenmill-example-toy"
    prompts = [[5, 17, 33, 8, 91], [120, 7, 7, 300, 41, 2, 99, 14, 250]]
    llm = LLM(str(toy_checkpoint), max_model_len=64, kv_cache_memory="8MiB")
    assert on_rank_zero(llm, _model_module) == "tokenmill_example_toy.model"
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    expected = hf_greedy(model_factory("llama"), prompts, 8)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in expected]


def test_blocking_a_plugin_removes_its_architecture(toy_checkpoint, monkeypatch):
    monkeypatch.setenv("TOKENMILL_BLOCK_PLUGINS", "toy")
    from tokenmill.plugins import manager as manager_module

    monkeypatch.setattr(manager_module, "_DEFAULT", None)
    with pytest.raises(UnsupportedModelError, match="ToyLMForCausalLM"):
        LLM(str(toy_checkpoint), max_model_len=64, kv_cache_memory="8MiB")
    monkeypatch.setattr(manager_module, "_DEFAULT", None)


def test_allow_list_loads_only_named_plugins():
    manager = PluginManager(allow=frozenset({"cpu", "sdpa"}))
    manager.load_entry_points()
    assert set(manager.infos) == {"tokenmill-core-defaults", "cpu", "sdpa"}


def test_duplicate_names_are_an_error_naming_both_distributions(tmp_path, monkeypatch):
    _installed("llama")
    (tmp_path / "llama_clone.py").write_text(
        "from tokenmill.hookspecs import hookimpl\n"
        "from tokenmill.plugins.specs import ModelSpec\n"
        "@hookimpl\n"
        "def tokenmill_register_models():\n"
        "    return {'LlamaForCausalLM': ModelSpec('llama_clone:Other')}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = PluginManager(allow=frozenset({"llama", "llama-clone"}))
    manager.load_entry_points()
    manager.load_entry_points([EntryPoint(name="llama-clone", value="llama_clone", group=ENTRY_POINT_GROUP)])
    with pytest.raises(PluginError, match="'LlamaForCausalLM' is registered by both") as error:
        manager.collect_named("tokenmill_register_models")
    assert "llama (tokenmill-models-llama 0.1.0)" in str(error.value)
    assert "llama-clone (unknown unknown)" in str(error.value)


def test_a_broken_plugin_is_reported_and_skipped_unless_strict():
    broken = EntryPoint(name="broken", value="tokenmill_no_such_module", group=ENTRY_POINT_GROUP)
    manager = PluginManager(allow=frozenset({"broken"}))
    manager.load_entry_points([broken])
    assert [f.info.name for f in manager.failures] == ["broken"]
    assert "ModuleNotFoundError" in manager.failures[0].error
    strict = PluginManager(strict=True)
    with pytest.raises(PluginError, match="broken"):
        strict.load_entry_points([broken])


def test_plugin_api_version_is_checked(tmp_path, monkeypatch):
    (tmp_path / "future_plugin.py").write_text("TOKENMILL_PLUGIN_API = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = PluginManager()
    manager.load_entry_points([EntryPoint(name="future", value="future_plugin", group=ENTRY_POINT_GROUP)])
    assert "plugin API 2" in manager.failures[0].error


def test_entry_point_modules_do_not_import_torch():
    import subprocess
    import sys

    modules = [ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)]
    code = ("import sys, importlib\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'an entry point imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


class _Plugin:
    """A plugin object built in the test (pluggy accepts any namespace)."""

    def __init__(self, **hooks: object) -> None:
        for name, function in hooks.items():
            setattr(self, name, hookimpl(function))


def _manager_with(**plugins: _Plugin) -> PluginManager:
    manager = PluginManager()
    for name, plugin in plugins.items():
        manager.register(plugin, PluginInfo(name, f"dist-{name}", "1.0", name))
    return manager


def test_collect_refuses_a_misspelled_hook_or_argument_at_once():
    manager = _manager_with()
    with pytest.raises(PluginError, match="'tokenmill_register_model' is not a tokenmill hook"):
        manager.collect("tokenmill_register_model")
    with pytest.raises(PluginError, match=r"takes \['platform'\], not \['platfrom'\]"):
        manager.collect("tokenmill_register_attention_backends", platfrom=None)


def test_collect_calls_through_pluggy_and_keeps_who_answered():
    manager = _manager_with(
        first=_Plugin(tokenmill_register_tool_parsers=lambda: {"a": "m:A"}),
        silent=_Plugin(tokenmill_register_tool_parsers=lambda: None),
        second=_Plugin(tokenmill_register_tool_parsers=lambda: {"b": "m:B"}),
    )
    seen: list[list[str]] = []
    manager.pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append([i.plugin_name for i in impls]),
                                       lambda outcome, name, impls, kwargs: None)
    results = manager.collect("tokenmill_register_tool_parsers")
    assert [(r.plugin.distribution, r.value) for r in results] == [("dist-second", {"b": "m:B"}),
                                                                   ("dist-first", {"a": "m:A"})]
    assert seen == [["second"], ["silent"], ["first"]]  # one pluggy call per implementation, in pluggy's order


def test_implementing_an_experimental_hook_warns_and_is_listed_as_such():
    class ReservedSpecs:  # a reserved hook, declared the way hookspecs.py declares one (none is, today)
        @hookspec(warn_on_impl=_experimental("tokenmill_reserved_hook"))
        def tokenmill_reserved_hook(self) -> None:
            """Reserved."""

    manager = PluginManager()
    manager.pm.add_hookspecs(ReservedSpecs)
    with pytest.warns(ExperimentalHookWarning, match="not called by this version"):
        manager.register(_Plugin(tokenmill_reserved_hook=lambda: None), PluginInfo("early", "dist-early", "1.0", "e"))
    assert manager.hooks_of("early") == ["tokenmill_reserved_hook"]
    assert not is_experimental("tokenmill_register_kv_connectors")  # it has a caller now
    assert not is_experimental("tokenmill_register_models")
