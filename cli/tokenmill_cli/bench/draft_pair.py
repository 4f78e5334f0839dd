"""A draft model that agrees with its target, for benchmarking speculative decoding on
random weights.

Two random-weight models share nothing: a draft proposes what its target would never pick,
and no draft-model speed-up can be shown. So the draft is derived from the target:

- ``write_layer_skip_draft``: the target's embedding, its first ``num_layers`` decoder layers,
  its final norm and lm_head, saved as a checkpoint of its own. A layer-skip self-draft, a real
  technique (self-speculative decoding, Zhang et al. 2023; LayerSkip, Elhoushi et al. 2024):
  the draft is the target stopped early.
- ``damp_later_layers``: a *benchmark device* for the random target, so that stopping early
  agrees with it. Every layer of a random model writes as much into the residual stream as any
  other, so skipping ten of twelve changes every prediction; the layers from ``first`` on get
  their output projections (attention ``o_proj``, MLP ``down_proj``) scaled by ``scale``, and
  perturb the residual stream little, much as a trained model's later layers refine what the
  earlier ones set up. The target still computes all its layers: its cost is unchanged, only
  how often its early exit agrees (the acceptance rate) is chosen.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def damp_later_layers(model: Any, first: int, scale: float) -> int:
    """Scale the output projections of ``model``'s decoder layers ``first..`` by ``scale``
    (a Llama-layout ``transformers`` model); returns how many layers were damped."""
    import torch

    layers = model.model.layers
    if not 0 <= first <= len(layers):
        raise ValueError(f"the model has {len(layers)} layers; cannot damp from layer {first}")
    with torch.no_grad():
        for layer in layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return len(layers) - first


def write_layer_skip_draft(target: Path, folder: Path, num_layers: int) -> int:
    """Save the first ``num_layers`` decoder layers of the safetensors checkpoint ``target``
    (with its embedding, final norm, lm_head and tokenizer) as a checkpoint in ``folder``;
    returns the draft's parameter count."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"the draft takes 1 to {total - 1} of the target's {total} layers, not {num_layers}")
    shards = sorted(target.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{target} has no safetensors weights to take a draft from")
    tensors = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as weights:
            for key in weights.keys():
                layer = _LAYER_KEY.search(key)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[key] = weights.get_tensor(key)
    folder.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():  # the tokenizer and generation config, as they are
        if item.is_file() and item.name != "config.json" and not any(item.match(p) for p in _WEIGHT_FILES):
            shutil.copy2(item, folder / item.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())
