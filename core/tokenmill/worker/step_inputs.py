"""Building one step's model inputs from the persistent batch, with numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.worker.input_batch import InputBatch

# Where numpy arrays (and so every input built here) are; no platform chooses this.
_HOST = torch.device("cpu")


@dataclass
class StepInputs:
    rows: np.ndarray  # batch rows scheduled this step, in order
    num_scheduled: np.ndarray  # tokens per scheduled row
    query_start: np.ndarray  # [len(rows) + 1]
    context_lens: np.ndarray  # tokens already in the cache per row
    sample_mask: np.ndarray  # rows that reach their last token and so sample
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def build_step_inputs(batch: InputBatch, num_scheduled_by_id: dict[str, int], device: torch.device) -> StepInputs:
    rows = np.array(sorted(batch.index_of[r] for r in num_scheduled_by_id), dtype=np.int64)
    counts = np.array([num_scheduled_by_id[batch.req_ids[r]] for r in rows], dtype=np.int64)
    query_start = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])

    token_req = np.repeat(np.arange(len(rows)), counts)  # which scheduled request each token belongs to
    offsets = np.arange(total) - query_start[:-1][token_req]
    context_lens = batch.num_computed_tokens[rows]
    positions = context_lens[token_req] + offsets
    token_rows = rows[token_req]
    input_ids = batch.token_ids[token_rows, positions]
    block_size = batch.block_size
    slot_mapping = batch.block_table[token_rows, positions // block_size] * block_size + positions % block_size
    seq_lens = context_lens + counts
    max_blocks = int(-(-seq_lens.max() // block_size))

    needs_copy = device != _HOST  # torch.from_numpy tensors live where numpy does
    # A copy from pageable memory is synchronous whatever non_blocking says; from pinned memory
    # (torch's caching host allocator, which keeps the block until the copy is done) it is not.
    pin = device.type == "cuda"

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if not needs_copy:
            return tensor  # a no-op .to() still dispatches
        return (tensor.pin_memory() if pin else tensor).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        num_reqs=len(rows),
        num_actual_tokens=total,
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_start_loc=to_device(query_start),
        seq_lens=to_device(seq_lens),
        context_lens=to_device(context_lens),
        block_table=to_device(batch.block_table[rows, :max_blocks]),
        slot_mapping=to_device(slot_mapping),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )
    return StepInputs(
        rows=rows,
        num_scheduled=counts,
        query_start=query_start,
        context_lens=context_lens,
        sample_mask=seq_lens >= batch.num_tokens[rows],
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        metadata=metadata,
    )
