"""Per-step attention metadata, common to every backend.

The model runner builds it once per step with numpy and copies it to the
device once; a backend may precompute its own extras from it once per step
(``backend_data``), which every layer then reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenmill.attention.item_blocks import BidirectionalBlock


@dataclass
class AttentionMetadata:
    """The scheduled tokens of one step, request after request.

    For request ``i`` the new tokens are ``query_start_loc[i]:query_start_loc[i+1]``
    of the flattened batch; they sit at positions ``context_lens[i] ..
    seq_lens[i] - 1`` of its sequence, whose KV lives in the blocks of
    ``block_table[i]``. ``slot_mapping[t]`` is where token ``t``'s KV is written
    in the flattened ``[num_blocks * block_size]`` cache.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    context_lens: torch.Tensor  # [num_reqs] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    backend_data: Any = None
    # The images whose tokens attend to each other both ways this step (Gemma 3); None: all
    # causal. See tokenmill.attention.item_blocks.
    bidirectional_blocks: list[BidirectionalBlock] | None = None
    # The latent (MLA) layers' gather index and mask for this step, built by the first of them
    # (tokenmill.attention.latent.latent_step_data) and reused by the rest.
    latent_data: Any = None
