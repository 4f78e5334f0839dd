"""Which quantization config a model is built with.

Quantization plugins register ``QuantMethodSpec``s; the one chosen names (by its
``qualname``) the :class:`~tokenmill.layers.QuantizationConfig` class that the
model's linear layers ask for their methods. In order of precedence:

1. the ``quantization`` engine option, by method name or checkpoint alias (it must
   agree with what the checkpoint declares, if anything);
2. the checkpoint's ``quantization_config["quant_method"]``, by checkpoint alias;
3. the single-file format whose loader produced the checkpoint (``Checkpoint.format``,
   e.g. ``gguf``).

None of them: no config, every layer float.
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import UnsupportedQuantizationError
from tokenmill.layers.quantization import QuantizationConfig
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.specs import QuantMethodSpec, resolve_qualname


def resolve_quant_config(checkpoint: Checkpoint, plugins: PluginManager, platform: Any,
                         requested: str | None = None) -> QuantizationConfig | None:
    """The quantization config for ``checkpoint`` (None: float), built from its
    ``quantization_config`` dict; ``requested`` is the ``quantization`` option."""
    registered = plugins.collect_named("tokenmill_register_quantization_methods", platform=platform)
    specs = [spec for _, spec in registered.values()]
    declared = checkpoint_quantization(checkpoint.hf_config)
    spec = choose_quant_method(specs, requested, declared.get("quant_method"), checkpoint.format)
    if spec is None:
        return None
    check_runs_on(spec, specs, getattr(platform, "device_type", None))
    config_cls = resolve_qualname(spec.qualname)
    if not (isinstance(config_cls, type) and issubclass(config_cls, QuantizationConfig)):
        raise TypeError(f"quantization method {spec.name!r}: {spec.qualname} is not a QuantizationConfig subclass")
    return config_cls.from_config(declared)


def checkpoint_quantization(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` as a dict ({} when it has none);
    transformers keeps it as a dict, or as an object for the methods it knows."""
    value = getattr(hf_config, "quantization_config", None)
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else dict(value.to_dict())


def choose_quant_method(specs: list[QuantMethodSpec], requested: str | None, declared: str | None,
                        checkpoint_format: str) -> QuantMethodSpec | None:
    """The registered method the precedence above picks (see the module docstring)."""
    if requested is not None:
        spec = _find(specs, requested, "the quantization option asks for")
        if declared is not None and _find(specs, declared, "the checkpoint declares") is not spec:
            raise UnsupportedQuantizationError(
                f"quantization={requested!r} does not match the checkpoint's quant_method {declared!r}",
                _installed(specs))
        return spec
    if declared is not None:
        return _find(specs, declared, "the checkpoint declares")
    return next((spec for spec in specs if spec.loader_qualname and _names(spec, checkpoint_format)), None)


def check_runs_on(spec: QuantMethodSpec, specs: list[QuantMethodSpec], device: str | None) -> None:
    """Refuse a method whose spec does not list ``device`` (the platform's device type), naming
    the methods that would run there."""
    if device is None or not spec.devices or device in spec.devices:
        return
    runnable = sorted(s.name for s in specs if not s.devices or device in s.devices)
    raise UnsupportedQuantizationError(
        f"quantization method {spec.name!r} does not run on {device} (it runs on {', '.join(spec.devices)}); "
        f"methods that run on {device}: {', '.join(runnable) or 'none'}", _installed(specs))


def _names(spec: QuantMethodSpec, name: str) -> bool:
    return name.casefold() in {n.casefold() for n in (spec.name, *spec.checkpoint_aliases)}


def _find(specs: list[QuantMethodSpec], name: str, who: str) -> QuantMethodSpec:
    for spec in specs:
        if _names(spec, name):
            return spec
    installed = _installed(specs)
    raise UnsupportedQuantizationError(
        f"{who} quantization method {name!r}, which no installed plugin provides; installed: "
        f"{', '.join(installed) or 'none'}", installed)


def _installed(specs: list[QuantMethodSpec]) -> list[str]:
    """Each method as ``name`` or ``name (alias, ...)``, for error messages."""
    return sorted(spec.name + (f" ({', '.join(spec.checkpoint_aliases)})" if spec.checkpoint_aliases else "")
                  for spec in specs)
