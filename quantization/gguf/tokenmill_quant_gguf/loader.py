"""Turning a ``.gguf`` file into a :class:`~tokenmill.model_loader.checkpoint.Checkpoint`."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from gguf import GGUFReader

from tokenmill.plugin_api import Checkpoint
from tokenmill_quant_gguf.architectures import architecture_of
from tokenmill_quant_gguf.hf_config import build_hf_config, generation_defaults
from tokenmill_quant_gguf.metadata import GGUFMetadata, read_metadata
from tokenmill_quant_gguf.tokenizer import load_gguf_tokenizer
from tokenmill_quant_gguf.weights import QKLayout, iter_gguf_weights

CHECKPOINT_FORMAT = "gguf"


def load_gguf_checkpoint(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Config, tokenizer and lazily read weights of a llama-family GGUF file.

    ``weights()`` may be called more than once; each call walks the memory-mapped
    file again and yields one tensor at a time under HF names: a linear layer's
    weight as its blocks (``qweight_type``, ``qweight``: :func:`iter_gguf_weights`),
    the others dequantised to ``dtype``. With no
    ``output`` tensor in the file, ``hf_config.tie_word_embeddings`` is true and
    no ``lm_head.weight`` is yielded.
    """
    path = Path(path)
    reader = GGUFReader(path)
    metadata = read_metadata(reader)
    _reject_split_file(path, metadata)
    arch = architecture_of(metadata)
    hf_config = build_hf_config(metadata, arch)
    # The tensor records hold views of the memory map, which keeps the file
    # mapped; dropping the reader frees its parsed vocabulary arrays.
    tensors = tuple(reader.tensors)
    del reader
    qk_layout = QKLayout(hf_config.num_attention_heads, hf_config.num_key_value_heads) if arch.permuted_qk else None
    return Checkpoint(
        path=path,
        hf_config=hf_config,
        weights=functools.partial(iter_gguf_weights, tensors, dtype, qk_layout, arch.leaf_overrides,
                                  arch.norm_weight_offset),
        tokenizer=load_gguf_tokenizer(path, metadata),
        generation_config=generation_defaults(metadata),
        format=CHECKPOINT_FORMAT,
    )


def _reject_split_file(path: Path, metadata: GGUFMetadata) -> None:
    # gguf-split shards hold a slice of the tensors each; loading one alone would
    # give a model with missing weights.
    shards = int(metadata.get("split.count", 1))
    if shards > 1:
        raise ValueError(
            f"{path.name} is shard {int(metadata.get('split.no', 0)) + 1} of {shards} of a split GGUF; "
            "merge the shards first (llama-gguf-split --merge)"
        )
