"""Random-weight Llama checkpoints of a chosen size, for benchmarks on a
machine with no model hub: transformers' ``save_pretrained`` (safetensors)
and a tokenizer, exactly as a downloaded folder looks.

The tokenizer has one token per character, over exactly the model's
vocabulary: four specials, then printable ASCII, then CJK and Hangul
characters. So every id decodes to exactly one visible character (a stream
sends one chunk per token, which keeps the server benchmark's ITL honest)
and a decoded prompt encodes back to the same ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill_cli.bench.draft_pair import damp_later_layers

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")  # ids 0..3: bos, eos, pad, unk
# Character ranges the vocabulary is filled from, in order (inclusive bounds).
_CHAR_RANGES = ((0x20, 0x7E), (0x0A, 0x0A), (0x09, 0x09), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x3400, 0x4DBF),
                (0x00A1, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x20000, 0x2A6DF))


@dataclass(frozen=True)
class LlamaSizes:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 32000
    max_position_embeddings: int = 2048


PRESETS: dict[str, LlamaSizes] = {
    # issue 6's benchmark models: "tiny" (58M parameters) and "100M" (125M with embeddings)
    "tiny": LlamaSizes(512, 1536, 8, 8, 4),
    "100m": LlamaSizes(768, 2048, 12, 12, 4),
}


def resolve_sizes(preset: str | None, **overrides: int | None) -> LlamaSizes:
    """A preset with explicit sizes on top; without a preset every size must be given."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset is not None:
        if preset.lower() not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        return replace(PRESETS[preset.lower()], **given)
    missing = [f for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads") if f not in given]
    if missing:
        raise ValueError(f"give --preset or every size; missing: {', '.join('--' + m.replace('_', '-') for m in missing)}")
    return LlamaSizes(**given)  # type: ignore[arg-type]


def write_random_model(folder: Path, sizes: LlamaSizes, seed: int = 0, dtype: str = "float32",
                       damp_layers_from: int | None = None, damp_scale: float = 0.01) -> int:
    """Save a random-weight ``LlamaForCausalLM`` and its tokenizer into ``folder``; returns the
    parameter count. ``damp_layers_from``: the layers from this one on write little into the
    residual stream (``draft_pair.damp_later_layers``), so that a layer-skip draft of the first
    ones agrees with the model: a benchmark device for speculative decoding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**asdict(sizes), bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if damp_layers_from is not None:
        damp_later_layers(model, damp_layers_from, damp_scale)
    model = model.to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer(folder, sizes.vocab_size)
    return sum(p.numel() for p in model.parameters())


def _characters() -> Iterator[str]:
    for low, high in _CHAR_RANGES:
        for code in range(low, high + 1):
            yield chr(code)


def build_char_tokenizer(folder: Path, vocab_size: int) -> Any:
    """A one-token-per-character tokenizer of exactly ``vocab_size`` ids, saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    most = len(SPECIAL_TOKENS) + sum(high - low + 1 for low, high in _CHAR_RANGES)
    if not len(SPECIAL_TOKENS) < vocab_size <= most:
        raise ValueError(f"vocab_size must be between {len(SPECIAL_TOKENS) + 1} and {most}, got {vocab_size}")
    chars = list(itertools.islice(_characters(), vocab_size - len(SPECIAL_TOKENS)))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE without merges: each character is its own token, unknown ones become <unk>
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # join the characters as they are, with no spaces between
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast
