"""Reading a PEFT LoRA adapter into host memory, validated against the base model.

A PEFT folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` (``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r] per target; an embedding's are ``<module>.lora_embedding_A``
[r, vocab] and ``lora_embedding_B`` [hidden, r], and PEFT saves a copy of the embedding's and
lm_head's base weights beside them, ``<module>.base_layer.weight``, which must be the base
model's shape: one with more rows adds tokens, which is not served). Loading resolves the path (a local folder, or
a Hub id through huggingface_hub, which honours ``HF_HUB_OFFLINE``), checks everything a
request would otherwise trip over later, and folds the scaling (alpha/r, or rsLoRA's
alpha/sqrt(r)) into B. Every problem is a :class:`LoRAAdapterError` naming the adapter.
It touches no engine state, so it runs on any thread (off the step loop).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from tokenmill.lora.errors import LoRAAdapterError
from tokenmill.lora.request import LoRARequest
from tokenmill.lora.targets import SUPPORTED_MODULES, VOCAB_MODULES, LoRATargetTable

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight"
                  r"|lora_embedding_(?P<embedding_ab>[AB])(?:\.[^.]+)?)$")
_BASE_LAYER = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")


@dataclass
class LoRAModuleWeights:
    """One target module's matrices: ``lora_a`` [r, in], ``lora_b`` [out, r] with the scaling folded in."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter loaded into host memory, ready to copy into a device slot."""

    name: str
    rank: int
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)  # checkpoint module -> weights
    content_hash: str = ""  # of its config and weights files: what its prefix-cache blocks are keyed by

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.modules.values())


@dataclass(frozen=True)
class LoRAAdapterLoader:
    """What an adapter is checked against: the base model's target table, ``max_lora_rank``
    and the dtype the slots hold."""

    targets: LoRATargetTable
    max_rank: int
    dtype: torch.dtype = torch.float32

    def load(self, request: LoRARequest) -> LoRAAdapter:
        name = request.lora_name
        folder = resolve_adapter_folder(request)
        config = _read_config(name, folder)
        rank = _rank(name, config, self.max_rank)
        _check_target_modules(name, config, self.targets)
        weights = _read_weights_file(name, folder)
        tensors = _parse_weights(name, folder, weights)
        _drop_saved_base_layers(name, tensors, self.targets)
        scaling = _scaling(name, config)
        adapter = LoRAAdapter(name, rank, content_hash=_content_hash(config, weights))
        pairs = _pairs(name, tensors)
        unknown = sorted(module for module in pairs if module not in self.targets)
        if unknown:
            raise LoRAAdapterError(name, f"targets modules {unknown}, which tokenmill cannot apply LoRA to in this "
                                         f"base model (LoRA can target {sorted(SUPPORTED_MODULES | VOCAB_MODULES)})")
        for module, (lora_a, lora_b) in pairs.items():
            target = self.targets[module]
            if lora_a.shape[0] > self.max_rank:
                raise LoRAAdapterError(name, f"module {module!r} has rank {lora_a.shape[0]}, above max_lora_rank="
                                             f"{self.max_rank}")
            if (tuple(lora_a.shape) != (lora_a.shape[0], target.in_features)
                    or tuple(lora_b.shape) != (target.out_features, lora_a.shape[0])):
                raise LoRAAdapterError(name, f"its weights for {module!r} (lora_A {tuple(lora_a.shape)}, lora_B "
                                             f"{tuple(lora_b.shape)}) do not fit the base model's layer "
                                             f"({target.in_features} -> {target.out_features} features): it was "
                                             "trained for another base model")
            r = lora_a.shape[0]
            adapter.modules[module] = LoRAModuleWeights(
                lora_a.to(self.dtype).contiguous(), (lora_b.float() * scaling(r)).to(self.dtype).contiguous())
        if not adapter.modules:
            raise LoRAAdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
        return adapter


def resolve_adapter_folder(request: LoRARequest) -> Path:
    """The adapter's local folder: ``lora_path`` itself, or its Hub snapshot."""
    path = Path(request.lora_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or request.lora_path.startswith(("/", ".", "~")) or request.lora_path.count("/") > 1:
        raise LoRAAdapterError(request.lora_name, f"no adapter folder at {request.lora_path!r}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(request.lora_path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as exc:  # offline, unknown repo, no network: all mean "not found"
        raise LoRAAdapterError(request.lora_name, f"no adapter folder at {request.lora_path!r}, and the Hub "
                                                  f"gave none ({type(exc).__name__}: {exc})") from exc


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(name, f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(name, f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(name, f"{file} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(name, f"it is a {config.get('peft_type')} adapter, not LoRA")
    unsupported = [key for key in ("use_dora", "alpha_pattern", "modules_to_save", "trainable_token_indices")
                   if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise LoRAAdapterError(name, f"uses PEFT features tokenmill does not serve: {unsupported}")
    return config


def _rank(name: str, config: dict[str, Any], max_rank: int) -> int:
    ranks = [config.get("r", 8), *dict(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise LoRAAdapterError(name, f"rank r={config.get('r')!r} is not a positive integer")
    rank = max(ranks)
    if rank > max_rank:
        raise LoRAAdapterError(name, f"rank {rank} is above max_lora_rank={max_rank}")
    return rank


def _check_target_modules(name: str, config: dict[str, Any], targets: LoRATargetTable) -> None:
    listed = config.get("target_modules")
    if not isinstance(listed, list):  # a regex or "all-linear": the weights file says what it targets
        return
    present = {module.rpartition(".")[2] for module in targets}
    missing = sorted(str(listed_name) for listed_name in listed
                     if not any(module == listed_name or module.endswith(f".{listed_name}") for module in targets))
    if missing:
        raise LoRAAdapterError(name, f"targets modules {missing}, which tokenmill cannot apply LoRA to in this "
                                     f"base model (it can target {sorted(present)})")


def _read_weights_file(name: str, folder: Path) -> bytes:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAAdapterError(name, f"{folder} has no {WEIGHTS_FILE}")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise LoRAAdapterError(name, f"{file} cannot be read ({exc})") from exc


def _parse_weights(name: str, folder: Path, weights: bytes) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load

        return load(weights)
    except Exception as exc:  # a truncated or garbled file
        raise LoRAAdapterError(name, f"{folder / WEIGHTS_FILE} is not a readable safetensors file "
                                     f"({type(exc).__name__}: {exc})") from exc


def _drop_saved_base_layers(name: str, tensors: dict[str, torch.Tensor], targets: LoRATargetTable) -> None:
    """Remove the copies of the embedding's and lm_head's base weights PEFT saves with their
    adapters (``save_embedding_layers``): the base model's own serve. Only a vocabulary layer's,
    of the base model's shape: more rows is a vocabulary the adapter grew, which is not served."""
    for key in [key for key in tensors if _BASE_LAYER.match(key)]:
        module = cast(re.Match[str], _BASE_LAYER.match(key))["module"]
        target = targets.get(module)
        if target is None or target.kind == "linear":
            raise LoRAAdapterError(name, f"{WEIGHTS_FILE} holds {key!r}, weights for the base model's {module!r} "
                                         "itself: only LoRA weights are served")
        vocab, hidden = ((target.in_features, target.out_features) if target.kind == "embedding"
                         else (target.out_features, target.in_features))
        shape = tuple(tensors.pop(key).shape)
        if shape != (vocab, hidden):
            grew = len(shape) == 2 and shape[1] == hidden and shape[0] > vocab
            raise LoRAAdapterError(name, (f"its {module!r} has {shape[0]} rows for the base model's vocabulary of "
                                          f"{vocab}: an adapter that adds tokens (extra vocabulary) is not served")
                                   if grew else f"its copy of {module!r} has shape {shape}, not the base model's "
                                                f"{(vocab, hidden)}: it was trained for another base model")


def _content_hash(config: dict[str, Any], weights: bytes) -> str:
    """What decides the adapter's effect on KV: its config (scaling, ranks) and its weights.
    Keying the prefix cache by it, not by the name, means a name re-registered with other
    weights never meets the old weights' blocks, and the same adapter under two names shares them."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(weights)
    return digest.hexdigest()


def _scaling(name: str, config: dict[str, Any]) -> Any:
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(name, f"lora_alpha={alpha!r} is not a number")
    if config.get("use_rslora"):
        return lambda r: alpha / math.sqrt(r)
    return lambda r: alpha / r


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(name, f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA A/B weight")
        halves.setdefault(match["module"], {})[match["ab"] or match["embedding_ab"]] = tensor
    incomplete = sorted(module for module, ab in halves.items() if set(ab) != {"A", "B"})
    if incomplete:
        raise LoRAAdapterError(name, f"modules {incomplete} lack their lora_A or lora_B weight")
    for module, ab in halves.items():
        if ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["A"].shape[0] != ab["B"].shape[1]:
            raise LoRAAdapterError(name, f"module {module!r}: lora_A {tuple(ab['A'].shape)} and lora_B "
                                         f"{tuple(ab['B'].shape)} are not a rank-r pair")
    return {module: (ab["A"], ab["B"]) for module, ab in halves.items()}
