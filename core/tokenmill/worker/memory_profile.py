"""The activation memory of the largest step, measured before the KV cache is sized.

A platform whose KV cache takes "what is left" of a device (the CUDA platform) must know
what a step needs besides the weights: the hidden states, the MLP's intermediate
activations, the attention backend's workspace and the logits, at the largest step the
scheduler will build (``max_num_batched_tokens`` tokens). :func:`profile_forward` runs that
step once — one request of that many tokens, a prompt of token id 0, through the model and
the lm_head of its last token — on a throwaway KV cache just large enough for it, and the
platform measures the peak around it (the optional ``ActivationProfiling`` capability,
tokenmill.platform). The layers are bound back to the runner's real cache, if it has one,
afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


def profile_metadata(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One prefill of ``num_tokens`` tokens whose KV fills blocks ``0..`` in order."""
    num_blocks = -(-num_tokens // block_size)
    query_start = np.array([0, num_tokens], dtype=np.int64)
    seq_lens = np.array([num_tokens], dtype=np.int64)
    return AttentionMetadata(
        num_reqs=1, num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=num_tokens,
        block_size=block_size, query_start_loc=torch.from_numpy(query_start).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device), context_lens=torch.zeros(1, dtype=torch.int64, device=device),
        block_table=torch.arange(num_blocks, device=device)[None, :], slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)


def profile_forward(runner: ModelRunner, num_tokens: int) -> Callable[[], None]:
    """The largest step as a function the platform times the memory of (see the module doc)."""

    @torch.inference_mode()
    def run() -> None:
        layers = runner.attention_layers
        saved = list(runner.kv_caches)
        num_blocks = -(-num_tokens // runner.block_size)
        try:
            for layer in layers:
                shape = (num_blocks, runner.block_size, layer.num_kv_heads, layer.head_size)
                scratch = (torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                           torch.zeros(shape, dtype=runner.dtype, device=runner.device))
                layer.bind(runner.backend, scratch)
            metadata = profile_metadata(num_tokens, runner.block_size, runner.device)
            metadata.backend_data = runner.backend.prepare(metadata)
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
            positions = torch.arange(num_tokens, device=runner.device)
            hidden = runner.model(input_ids, positions, metadata)
            runner.model.compute_logits(hidden[-1:])
        finally:
            for index, layer in enumerate(layers):  # drop the scratch cache: nothing may keep it alive
                if saved:
                    layer.bind(runner.backend, saved[index])
                else:
                    layer.kv_cache = None

    return run
