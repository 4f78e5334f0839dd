"""LongRoPE ("su") rotary embedding (Phi-3 128k, Phi-3.5): two sets of frequencies, the
``short_factor`` ones for sequences within the original training length and the
``long_factor`` ones beyond it.

transformers picks the set per forward call from the longest sequence in it: a prompt
longer than ``original_max_position_embeddings`` is rotated with the long factors
throughout, a shorter one with the short factors, and each decode step with the long
factors once its position reaches that length (the keys already cached keep their
rotation). Here the choice is per request and per step in the same way: a request's
new tokens use the long factors when its sequence, with them, is longer than the
original length. Both sets live in one table, short rows first (only the original
length's worth: a position past it is always long) then long rows, and
:meth:`LongRopeRotaryEmbedding.rope_positions` turns positions into rows. With
chunked prefill a prompt's first chunks can differ from transformers, which never
splits a prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.rotary import RotaryEmbedding, rope_inverse_frequencies, rope_parameters, rope_table


class LongRopeRotaryEmbedding(RotaryEmbedding):
    def __init__(self, hf_config: Any, head_size: int, max_position: int, layer_type: str | None = None) -> None:
        nn.Module.__init__(self)  # the table is not RotaryEmbedding's single one
        params = rope_parameters(hf_config, layer_type)
        original = params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        self.original_max_position = int(original)
        with torch.device("cpu"):
            short_freq, scaling = rope_inverse_frequencies(hf_config, head_size, layer_type)
            long_freq, _ = rope_inverse_frequencies(hf_config, head_size, layer_type,
                                                    seq_len=self.original_max_position + 1)
        short_cos, short_sin = rope_table(short_freq, scaling, self.original_max_position)
        long_cos, long_sin = rope_table(long_freq, scaling, max_position)
        self.set_table(torch.cat((short_cos, long_cos)), torch.cat((short_sin, long_sin)))

    def rope_positions(self, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Row of each token: its position, offset into the long rows when its request's
        sequence after this step is longer than the original length."""
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        seq_lens = torch.repeat_interleave(metadata.seq_lens, query_lens, output_size=positions.shape[0])
        is_long = (seq_lens > self.original_max_position).to(positions.dtype)
        return positions + is_long * self.original_max_position
