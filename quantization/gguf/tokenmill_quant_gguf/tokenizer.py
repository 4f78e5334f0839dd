"""The fast tokenizer a GGUF file embeds, with its chat template(s).

transformers builds the ``tokenizers`` backend from the ``tokenizer.ggml.*``
arrays. We call the fast-tokenizer class directly rather than ``AutoTokenizer``:
for GGUF, AutoTokenizer first re-parses the whole file through ``GGUFReader``
just to build a config (seconds), then lands on this same class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from tokenmill_quant_gguf.metadata import GGUFMetadata

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
NAMED_TEMPLATE_PREFIX = "tokenizer.chat_template."
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def load_gguf_tokenizer(path: Path, metadata: GGUFMetadata) -> PreTrainedTokenizerFast:
    """The GGUF file's tokenizer, its special tokens and chat template(s) set from metadata."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    _set_special_tokens(tokenizer, metadata)
    template = chat_template(metadata)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def chat_template(metadata: GGUFMetadata) -> str | dict[str, str] | None:
    """``tokenizer.chat_template``, or a ``{name: template}`` dict when named ones exist.

    llama.cpp stores extra templates (e.g. ``tool_use``) under
    ``tokenizer.chat_template.<name>``; transformers keeps several templates as
    a dict whose unnamed one is called ``default``.
    """
    default = metadata.get(CHAT_TEMPLATE_KEY)
    named: dict[str, Any] = {
        key.removeprefix(NAMED_TEMPLATE_PREFIX): value
        for key, value in metadata.values.items()
        if key.startswith(NAMED_TEMPLATE_PREFIX) and isinstance(value, str)
    }
    if not named:
        return default
    if default is not None:
        named = {"default": default, **named}
    return named


def _set_special_tokens(tokenizer: PreTrainedTokenizerFast, metadata: GGUFMetadata) -> None:
    # transformers already sets these from the same ids; this pins them when a
    # transformers version leaves one unset.
    for attribute, key in SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if token_id is not None and getattr(tokenizer, f"{attribute}_id") is None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(int(token_id)))
