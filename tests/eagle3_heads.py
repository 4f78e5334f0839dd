"""EAGLE-3 heads for a tiny target, written in the on-disk layout the published heads have
(``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``: a one-layer Llama ``config.json`` with
``draft_vocab_size``; ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d`` in safetensors), and a plain torch computation of the drafts such a head
proposes, written from the published architecture (the reference the proposer is checked
against)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# The tiny target has two layers: the head reads the embeddings, the first layer's output and
# the last one's (before the final norm), as a real head reads (2, L // 2, L - 3).
TINY_LAYER_IDS = [0, 1, 2]


def _head_config(target: Path, draft_vocab_size: int, layer_ids: list[int] | None, hidden_size: int | None,
                 **extra: object) -> dict:
    target_config = json.loads((target / "config.json").read_text())
    config = {key: target_config[key] for key in (
        "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "rms_norm_eps", "bos_token_id", "eos_token_id")}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
                  hidden_size=hidden_size or target_config["hidden_size"], num_hidden_layers=1,
                  draft_vocab_size=draft_vocab_size, tie_word_embeddings=False, **extra)
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    return config


def _save(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    return folder


def _draft_vocabulary(vocab_size: int, draft_vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Target ids of the draft tokens, ascending (as the published heads order them)."""
    return torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values


def build_eagle3_head(folder: Path, target: Path, seed: int = 0, draft_vocab_size: int = 256,
                      layer_ids: list[int] | None = TINY_LAYER_IDS, hidden_size: int | None = None,
                      with_d2t: bool = True, own_embedding: bool = False, max_positions: int = 64) -> Path:
    """A random-weight head for ``target``, its draft vocabulary a random subset of the target's
    (with an ``embed_tokens.weight`` of its own, where ``own_embedding``). Like the published
    heads, it declares fewer positions (``max_positions``) than the engine runs it over."""
    config = _head_config(target, draft_vocab_size, layer_ids, hidden_size, max_position_embeddings=max_positions)
    hidden, target_hidden = config["hidden_size"], json.loads((target / "config.json").read_text())["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_size = hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    def norm() -> torch.Tensor:
        return 1 + rand(hidden)

    inter = config["intermediate_size"]
    weights = {
        "fc.weight": rand(hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_size, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_size, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_size, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_size),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": torch.randn(draft_vocab_size, hidden, generator=generator) * 0.5,
    }
    vocab = _draft_vocabulary(config["vocab_size"], draft_vocab_size, generator)
    if with_d2t:
        weights["d2t"] = vocab - torch.arange(draft_vocab_size)
    if own_embedding:
        weights["embed_tokens.weight"] = torch.randn(config["vocab_size"], hidden, generator=generator)
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[vocab] = True
    weights["t2d"] = t2d
    return _save(folder, config, weights)


def build_copying_target(folder: Path, target: Path) -> Path:
    """``target`` with every layer's o_proj and down_proj zeroed: its final hidden state is the
    last token's embedding, so its next token is a function of the current one."""
    shutil.copytree(target, folder)
    weights = load_file(str(target / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def build_agreeing_eagle3_head(folder: Path, copying_target: Path, seed: int = 0, scale: float = 10.0) -> Path:
    """A head that predicts what a :func:`build_copying_target` target predicts, by its
    weights alone: ``fc`` and the hidden norm zero, each attention head attends (sharply, ``scale``) to the
    position whose normed embedding best matches its own — itself — and passes that
    embedding on; the MLP adds nothing; the final norm and the lm_head are the target's, over
    a draft vocabulary that is the whole target vocabulary in a shuffled order (so ``d2t``
    is exercised)."""
    target_config = json.loads((copying_target / "config.json").read_text())
    vocab, hidden = target_config["vocab_size"], target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    # norm_before_residual with a zero hidden_norm: the residual stream starts at zero, also at
    # the draft steps (where the hidden state is the head's own last output)
    config = _head_config(copying_target, vocab, TINY_LAYER_IDS, None, num_key_value_heads=heads,
                          norm_before_residual=True)
    target_weights = load_file(str(copying_target / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(vocab, generator=generator)  # draft token d is target token order[d]
    embedding_half = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)  # reads the embeds
    inter = config["intermediate_size"]
    weights = {
        "fc.weight": torch.zeros(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden), "midlayer.hidden_norm.weight": torch.zeros(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": scale * embedding_half,
        "midlayer.self_attn.k_proj.weight": embedding_half.clone(),
        "midlayer.self_attn.v_proj.weight": embedding_half.clone(),
        "midlayer.self_attn.o_proj.weight": torch.eye(hidden),
        "midlayer.mlp.gate_proj.weight": torch.zeros(inter, hidden),
        "midlayer.mlp.up_proj.weight": torch.zeros(inter, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, inter),
        "norm.weight": target_weights["model.norm.weight"].clone(),
        "lm_head.weight": target_weights["lm_head.weight"][order].clone(),
        "d2t": order - torch.arange(vocab),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    }
    return _save(folder, config, weights)


# -- the reference ------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of ``x`` [S, heads, D] at ``positions``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def _eagle3_layer(w: dict[str, torch.Tensor], config: dict, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The EAGLE-3 decoder layer over a whole sequence (causal), as published: attention over
    ``cat(input_layernorm(embeds), hidden_norm(hidden))``, the residual starting at ``hidden``
    (at ``hidden_norm(hidden)`` with ``norm_before_residual``);
    returns the residual stream after the MLP (before the final norm)."""
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    head_size = config["hidden_size"] // heads
    theta = float(config.get("rope_theta", 10000.0))
    normed_hidden = _rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([_rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps), normed_hidden], -1)
    length = len(x)
    positions = torch.arange(length)
    q = _rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(length, heads, head_size), positions, theta)
    k = _rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(length, kv_heads, head_size), positions, theta)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(length, kv_heads, head_size)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_size ** 0.5
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * head_size)
    residual = (normed_hidden if config.get("norm_before_residual") else hidden) + \
        attended @ w["midlayer.self_attn.o_proj.weight"].T
    normed = _rms_norm(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = normed @ w["midlayer.mlp.gate_proj.weight"].T, normed @ w["midlayer.mlp.up_proj.weight"].T
    return residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T


def target_layer_states(target: Path, context: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, Any]:
    """transformers' residual stream entering each of ``layer_ids`` (id ``L``: the final
    norm's input), concatenated, at every position of ``context``; and the target's embedding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    inputs: dict[int, torch.Tensor] = {}
    blocks = [*model.model.layers, model.model.norm]
    hooks = [block.register_forward_pre_hook(
        lambda _module, args, kwargs, index=index: inputs.__setitem__(index, (args or (kwargs["hidden_states"],))[0]),
        with_kwargs=True) for index, block in enumerate(blocks)]
    with torch.no_grad():
        model.model(torch.tensor([context]))
    for hook in hooks:
        hook.remove()
    return torch.cat([inputs[i][0] for i in layer_ids], -1), model.get_input_embeddings()


def reference_eagle3_drafts(target: Path, head: Path, context: list[int], k: int) -> list[int]:
    """The ``k`` greedy drafts after ``context``: ``fc`` over transformers' three layer states
    at positions ``0 .. n-2``, beside the embeddings of tokens ``1 .. n-1``; the layer over the
    whole sequence, recomputed at each draft; each draft from ``lm_head(norm(out[-1]))`` mapped
    by ``d2t``, the next position reading its embedding and ``out[-1]``. The embeddings are the
    head's own where it has some."""
    config = json.loads((head / "config.json").read_text())
    w = load_file(str(head / "model.safetensors"))
    states, embed = target_layer_states(target, context, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if "embed_tokens.weight" in w:  # the head's own, else the target's
        embed = torch.nn.Embedding.from_pretrained(w["embed_tokens.weight"])
    with torch.no_grad():
        ids = torch.tensor(context)
        hidden = states[:-1] @ w["fc.weight"].T
        embeds = embed(ids[1:])
        drafts: list[int] = []
        for _ in range(k):
            out = _eagle3_layer(w, config, embeds, hidden)[-1]
            draft = int((_rms_norm(out, w["norm.weight"], config["rms_norm_eps"]) @ w["lm_head.weight"].T).argmax())
            token = draft + int(w["d2t"][draft])
            drafts.append(token)
            embeds = torch.cat([embeds, embed(torch.tensor([token]))])
            hidden = torch.cat([hidden, out[None]])
    return drafts
