"""`tokenmill plugins` lists every installed plugin with its distribution and what it registers."""

from __future__ import annotations

import subprocess
import sys


def test_lists_installed_plugins_and_their_names():
    result = subprocess.run([sys.executable, "-m", "tokenmill_cli.main", "plugins"], capture_output=True,
                            text=True, timeout=120, env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("tokenmill-platform-cpu", "tokenmill-models-llama", "LlamaForCausalLM", "sdpa", "cpu-paged",
                     "tokenmill-example-toy", "ToyLMForCausalLM", "quantization: gguf", "hermes",
                     "structured-output: xgrammar"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
