"""The plugin boundary: every shipped plugin imports tokenmill only through its public surface
(``tokenmill``, ``tokenmill.plugin_api``, ``tokenmill.layers``, ``tokenmill.lora``, each by its ``__all__``) and never
another plugin's package. The imports are read from the source (ast), so a lazy import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import tokenmill
import tokenmill.layers
import tokenmill.lora
import tokenmill.plugin_api

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_FOLDERS = ("platforms", "attention", "models", "quantization", "plugins", "speculative", "tests/plugins")
PUBLIC = {module.__name__: frozenset(module.__all__) for module in (tokenmill, tokenmill.plugin_api, tokenmill.layers,
                                                                   tokenmill.lora)}


def _plugin_packages() -> list[Path]:
    """Each distribution's importable package (``<folder>/<dist>/tokenmill_*``), its tests left out."""
    return sorted(package for folder in PLUGIN_FOLDERS for package in (ROOT / folder).glob("*/tokenmill_*")
                  if package.is_dir() and (package / "__init__.py").is_file())


def _imports(source: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import in ``source``; ``name`` is None for ``import module``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def boundary_violations(package: Path) -> list[str]:
    """Each import of ``package`` that leaves the public surface, as ``file:line: import``."""
    own = package.name
    problems = []
    for source in sorted(package.rglob("*.py")):
        for line, module, name in _imports(source):
            where = f"{source.relative_to(ROOT)}:{line}: " + (f"from {module} import {name}" if name else f"import {module}")
            top = module.split(".")[0]
            if top == "tokenmill":
                if module not in PUBLIC:
                    problems.append(f"{where} ({module} is internal; use tokenmill.plugin_api)")
                elif name is not None and name not in PUBLIC[module]:
                    problems.append(f"{where} ({name!r} is not in {module}.__all__)")
            elif top.startswith("tokenmill_") and top != own:
                problems.append(f"{where} (another plugin's package)")
    return problems


def test_every_shipped_plugin_imports_only_the_public_surface():
    packages = _plugin_packages()
    names = {package.name for package in packages}
    assert {"tokenmill_platform_cpu", "tokenmill_platform_cuda", "tokenmill_attn_sdpa", "tokenmill_models_llama",
            "tokenmill_quant_gguf", "tokenmill_tool_parsers", "tokenmill_example_toy"} <= names, names
    problems = [problem for package in packages for problem in boundary_violations(package)]
    assert not problems, "plugins import outside tokenmill's public surface:\n" + "\n".join(problems)


def test_the_check_names_the_file_and_the_import(tmp_path, monkeypatch):
    package = tmp_path / "plugins" / "tokenmill-bad" / "tokenmill_bad"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from tokenmill.plugin_api import hookimpl\n"
        "from tokenmill.config import EngineConfig\n"
        "def later():\n"
        "    import tokenmill.worker.step_graphs\n"
        "    from tokenmill.layers import NoSuchLayer\n"
        "    from tokenmill_platform_cpu.kernels import load_kernels\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert boundary_violations(package) == [
        "plugins/tokenmill-bad/tokenmill_bad/__init__.py:2: from tokenmill.config import EngineConfig "
        "(tokenmill.config is internal; use tokenmill.plugin_api)",
        "plugins/tokenmill-bad/tokenmill_bad/__init__.py:4: import tokenmill.worker.step_graphs "
        "(tokenmill.worker.step_graphs is internal; use tokenmill.plugin_api)",
        "plugins/tokenmill-bad/tokenmill_bad/__init__.py:5: from tokenmill.layers import NoSuchLayer "
        "('NoSuchLayer' is not in tokenmill.layers.__all__)",
        "plugins/tokenmill-bad/tokenmill_bad/__init__.py:6: from tokenmill_platform_cpu.kernels import load_kernels "
        "(another plugin's package)",
    ]


@pytest.mark.parametrize("name", sorted(tokenmill.plugin_api.__all__))
def test_every_public_name_resolves(name):
    assert getattr(tokenmill.plugin_api, name) is not None


def test_the_surface_loads_without_torch():
    """An entry-point module imports the hook marker and spec records from here, torch-free."""
    import subprocess

    code = ("import sys\n"
            "from tokenmill.plugin_api import ModelSpec, PlatformSpec, hookimpl\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('tokenmill'))\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_names_are_the_internal_objects():
    """Re-exports, not copies: isinstance and except clauses see one class."""
    assert tokenmill.plugin_api.StepGraphUnsupported is importlib.import_module(
        "tokenmill.worker.step_graphs").StepGraphUnsupported
    assert tokenmill.plugin_api.EngineConfig is tokenmill.EngineConfig


def test_lora_request_is_one_class_under_both_names():
    """``from tokenmill import LoRARequest`` and ``from tokenmill.lora import LoRARequest`` (vLLM's spelling)."""
    assert tokenmill.LoRARequest is tokenmill.lora.LoRARequest
    assert "LoRARequest" in tokenmill.__all__ and "LoRARequest" in tokenmill.lora.__all__
