"""`tokenmill plugins` lists every installed plugin with its distribution and what it registers,
and every hook the spec module declares, flagging those this version never calls."""

from __future__ import annotations

import os
import subprocess
import sys

from tokenmill import hookspecs


def _run_plugins_command() -> str:
    env = {"COLUMNS": "250", "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # the checkout under test, where it is not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    result = subprocess.run([sys.executable, "-m", "tokenmill_cli.main", "plugins"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_lists_installed_plugins_and_their_names():
    out = _run_plugins_command()
    for expected in ("tokenmill-platform-cpu", "tokenmill-models-llama", "LlamaForCausalLM", "sdpa", "cpu-paged",
                     "tokenmill-example-toy", "ToyLMForCausalLM", "quantization-methods: gguf", "hermes",
                     "structured-output-backends: xgrammar", "reasoning-parsers: deepseek_r1, qwen3",
                     "tokenmill-models-gemma", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert expected in out, f"{expected!r} missing from:\n{out}"


def test_lists_every_declared_hook_and_flags_the_experimental_ones():
    lines = _run_plugins_command().splitlines()
    experimental = [h for h in hookspecs.hook_names() if hookspecs.is_experimental(h)]
    assert experimental == []  # every declared hook has a caller in this version
    for hook in hookspecs.hook_names():
        row = next((line for line in lines if f" {hook} " in line), None)
        assert row is not None, f"{hook} missing from the hooks table"
        assert ("not called by this version" in row) == (hook in experimental), row


def test_a_plugin_implementing_a_reserved_hook_sees_it_flagged(monkeypatch):
    from tokenmill_cli.plugins import _hook_label

    def tokenmill_reserved_hook() -> None:
        """A reserved hook, declared the way hookspecs.py declares one."""

    reserved = hookspecs.hookspec(warn_on_impl=hookspecs._experimental("tokenmill_reserved_hook"))(
        tokenmill_reserved_hook)
    monkeypatch.setattr(hookspecs, "tokenmill_reserved_hook", reserved, raising=False)
    assert _hook_label("tokenmill_reserved_hook") == "reserved_hook (not called by this version)"
    assert _hook_label("tokenmill_register_kv_connectors") == "register_kv_connectors"
