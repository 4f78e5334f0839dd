"""Random-weight EAGLE-1 heads for a tiny target, written in the on-disk layout published heads
have (``config.json`` of a one-layer Llama; ``fc.weight``, ``layers.0.*`` without an input
norm, and a copy of the target's ``embed_tokens.weight``), plus transformers' computation of
the drafts such a head proposes (the reference the proposer is checked against)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def build_eagle_head(folder: Path, target: Path, seed: int = 0, hidden_size: int | None = None,
                     bin_format: bool = False, fc_bias: bool = False) -> Path:
    """Save a head for ``target`` into ``folder`` (safetensors, or ``pytorch_model.bin`` with
    the ``fc.bias`` the first published heads have, where ``fc_bias``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    target_config = json.loads((target / "config.json").read_text())
    hidden = hidden_size or target_config["hidden_size"]
    config = LlamaConfig(**{key: target_config[key] for key in (
        "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "rms_norm_eps", "bos_token_id", "eos_token_id")}, hidden_size=hidden, num_hidden_layers=1)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
    with torch.no_grad():
        for parameter in [*layer.parameters(), fc.weight]:
            if parameter.dim() == 2:
                parameter.normal_(0, 0.1)
    weights = {f"layers.0.{name}": tensor for name, tensor in layer.state_dict().items()
               if not name.startswith("input_layernorm.")}
    weights["fc.weight"] = fc.weight.detach()
    if fc.bias is not None:
        weights["fc.bias"] = fc.bias.detach()
    weights["embed_tokens.weight"] = torch.zeros(config.vocab_size, hidden)  # shared: the target's is used
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weights = {name: tensor.contiguous() for name, tensor in weights.items()}
    if bin_format:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(weights, str(folder / "model.safetensors"))
    return folder


def hf_eagle_drafts(target: Path, head: Path, context: list[int], k: int) -> list[int]:
    """The ``k`` greedy drafts after ``context``, with transformers: the target's final hidden
    states of the whole context, the head as transformers' LlamaDecoderLayer (its input norm an
    identity) recomputed over the whole sequence at each draft, the target's lm_head."""
    return [int(row.argmax()) for row in _hf_eagle_logits(target, head, context, k, None)]


def hf_eagle_draft_logits(target: Path, head: Path, context: list[int], drafts: list[int]) -> torch.Tensor:
    """``[len(drafts), V]``: the logits each of ``drafts`` is drawn from, the head fed ``drafts``
    (as :func:`hf_eagle_drafts` computes them)."""
    return torch.stack(_hf_eagle_logits(target, head, context, len(drafts), drafts))


def _hf_eagle_logits(target: Path, head: Path, context: list[int], k: int,
                     given: list[int] | None) -> list[torch.Tensor]:
    """The head's logits at each of ``k`` draft steps, each step's token the argmax or ``given``'s."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = LlamaConfig.from_pretrained(head)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    weights = _read(head)
    layer.load_state_dict({name.removeprefix("layers.0."): t for name, t in weights.items()
                           if name.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = nn.Identity()
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias="fc.bias" in weights)
    fc.weight.data = weights["fc.weight"]
    if fc.bias is not None:
        fc.bias.data = weights["fc.bias"]
    config._attn_implementation = "eager"
    rotary = LlamaRotaryEmbedding(config)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        ids = torch.tensor([context])
        target_hidden = model.model(ids).last_hidden_state[0]
        inputs = fc(torch.cat([embed(ids[0, 1:]), target_hidden[:-1]], dim=-1))
        logits: list[torch.Tensor] = []
        for step in range(k):
            positions = torch.arange(len(inputs))[None]
            causal = torch.full((len(inputs), len(inputs)), float("-inf")).triu(1)[None, None]
            out = layer(inputs[None], attention_mask=causal, position_embeddings=rotary(inputs[None], positions),
                        position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1:]
            logits.append(model.lm_head(last)[0])
            token = int(logits[-1].argmax()) if given is None else given[step]
            inputs = torch.cat([inputs, fc(torch.cat([embed(torch.tensor([token])), last], dim=-1))])
    return logits


def _read(head: Path) -> dict[str, torch.Tensor]:
    if (head / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(head / "model.safetensors"))
    return torch.load(head / "pytorch_model.bin", weights_only=True)
