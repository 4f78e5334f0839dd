"""Choosing how to read a checkpoint and which class implements it.

Single-file formats (``.gguf``) belong to quantization plugins that claim
their suffix; folders are read as Hugging Face safetensors checkpoints.
The model class comes from the registered architectures, unless a platform
plugin answers ``tokenmill_resolve_model_class`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelNotFoundError, UnsupportedModelError
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.resolve import resolve_model_path
from tokenmill.model_loader.safetensors_folder import load_safetensors_folder
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.specs import ModelSpec, resolve_qualname


def default_model(plugins: PluginManager) -> str:
    model = plugins.hook.tokenmill_default_model()
    if model is None:
        raise ModelNotFoundError("no model given and no plugin provides a default model")
    return str(model)


def load_checkpoint(model: str, plugins: PluginManager, platform: Any, dtype: torch.dtype,
                    revision: str | None = None, tokenizer: str | None = None) -> Checkpoint:
    path = resolve_model_path(model, revision)
    if path.is_file():
        return _load_single_file(path, plugins, platform, dtype)
    single = [f for f in path.glob("*.gguf")] if not any(path.glob("*.safetensors")) else []
    if len(single) == 1 and not (path / "config.json").is_file():
        return _load_single_file(single[0], plugins, platform, dtype)
    return load_safetensors_folder(path, dtype, tokenizer)


def _load_single_file(path: Path, plugins: PluginManager, platform: Any, dtype: torch.dtype) -> Checkpoint:
    methods = plugins.collect_named("tokenmill_register_quantization_methods", platform=platform)
    for _, spec in methods.values():
        if spec.loader_qualname and path.name.endswith(spec.file_suffixes):
            return resolve_qualname(spec.loader_qualname)(path, dtype)
    raise UnsupportedModelError(f"no installed plugin reads {path.suffix or path.name} files ({path})")


def registered_model_spec(checkpoint: Checkpoint, plugins: PluginManager) -> ModelSpec | None:
    """The spec a plugin registered for the checkpoint's first registered architecture, if any."""
    registered = {arch: spec for arch, (_, spec) in plugins.collect_named("tokenmill_register_models").items()}
    return next((registered[arch] for arch in checkpoint.architectures if arch in registered), None)


def resolve_model_class(checkpoint: Checkpoint, plugins: PluginManager, platform: Any) -> type:
    registered = {arch: spec for arch, (_, spec) in plugins.collect_named("tokenmill_register_models").items()}
    for arch in checkpoint.architectures:
        qualname = plugins.hook.tokenmill_resolve_model_class(
            architecture=arch, hf_config=checkpoint.hf_config, platform=platform)
        if qualname is None and arch in registered:
            qualname = registered[arch].qualname
        if qualname is not None:
            return resolve_qualname(qualname)
    raise UnsupportedModelError(
        f"architecture {checkpoint.architectures or '(none in config.json)'} is not supported by any installed "
        f"model plugin; supported: {sorted(registered)}. A model plugin adds architectures: see docs/plugins.md "
        "(\"A model plugin\")"
    )
