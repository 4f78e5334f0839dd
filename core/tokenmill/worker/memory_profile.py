"""The activation memory of the largest step, measured before the KV cache is sized.

A platform whose KV cache takes "what is left" of a device (the CUDA platform) must know
what a step needs besides the weights: the hidden states, the MLP's intermediate
activations, the attention backend's workspace and the logits, at the largest step the
scheduler will build (``max_num_batched_tokens`` tokens). :func:`profile_forward` runs that
step once — that many tokens as whole prompts of token id 0, none longer than
``max_model_len``, through the model and the lm_head of each prompt's last token — on a
throwaway KV cache just large enough for it, and the
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


def profile_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The prompt lengths of the largest step: ``num_tokens`` split into requests no longer than
    ``max_model_len`` (no position beyond what the model serves), at most ``max_num_seqs`` of them."""
    lengths: list[int] = []
    remaining = num_tokens
    while remaining > 0 and len(lengths) < max_num_seqs:
        lengths.append(min(remaining, max_model_len))
        remaining -= lengths[-1]
    return lengths


def profile_metadata(lengths: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """Whole prefills of ``lengths`` tokens, their KV in consecutive blocks, request after request."""
    seq_lens = np.array(lengths, dtype=np.int64)
    query_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=query_start[1:])
    blocks = -(-seq_lens // block_size)
    width = int(blocks.max())
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    table = first[:, None] + np.minimum(np.arange(width)[None, :], blocks[:, None] - 1)
    positions = np.arange(int(query_start[-1])) - np.repeat(query_start[:-1], seq_lens)
    token_req = np.repeat(np.arange(len(lengths)), seq_lens)
    slots = table[token_req, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        num_reqs=len(lengths), num_actual_tokens=int(query_start[-1]), max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=block_size, query_start_loc=torch.from_numpy(query_start).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        context_lens=torch.zeros(len(lengths), dtype=torch.int64, device=device),
        block_table=torch.from_numpy(table).to(device), slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)


def profile_forward(runner: ModelRunner, num_tokens: int) -> Callable[[], None]:
    """The largest step as a function the platform measures the memory of (see the module doc)."""
    lengths = profile_lengths(num_tokens, runner.batch.max_model_len, runner.batch.max_num_reqs)

    @torch.inference_mode()
    def run() -> None:
        layers = runner.attention_layers
        saved = list(runner.kv_caches)
        num_blocks = sum(-(-n // runner.block_size) for n in lengths)
        try:
            for layer in layers:
                scratch = layer.kv_cache_spec.allocate(
                    lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=runner.device), num_blocks,
                    runner.block_size, runner.dtype)
                layer.bind(runner.backend, scratch)
            metadata = profile_metadata(lengths, runner.block_size, runner.device)
            metadata.backend_data = runner.backend.prepare(metadata)
            starts = metadata.query_start_loc_cpu
            positions = np.arange(int(starts[-1])) - np.repeat(starts[:-1], metadata.seq_lens_cpu)
            input_ids = torch.zeros(len(positions), dtype=torch.int64, device=runner.device)
            hidden = runner.model(input_ids, torch.from_numpy(positions).to(runner.device), metadata)
            runner.model.compute_logits(hidden[torch.from_numpy(starts[1:] - 1).to(runner.device)])
        finally:
            for index, layer in enumerate(layers):  # drop the scratch cache: nothing may keep it alive
                if saved:
                    layer.bind(runner.backend, saved[index])
                else:
                    layer.kv_cache = None

    return run
