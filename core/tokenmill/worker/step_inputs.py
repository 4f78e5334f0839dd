"""Building one step's model inputs from the persistent batch, with numpy."""

from __future__ import annotations

from collections.abc import Callable
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
    if len(num_scheduled_by_id) == batch.num_reqs:  # every row runs: the rows are 0 .. n-1 (no sort)
        rows = np.arange(batch.num_reqs, dtype=np.int64)
    else:
        rows = np.array(sorted(batch.index_of[r] for r in num_scheduled_by_id), dtype=np.int64)
    if rows.size and min(num_scheduled_by_id.values()) == max(num_scheduled_by_id.values()) == 1:
        return _decode_step_inputs(batch, rows, device)  # one token per request
    return _step_inputs(batch, rows, num_scheduled_by_id, device)


def _step_inputs(batch: InputBatch, rows: np.ndarray, num_scheduled_by_id: dict[str, int],
                 device: torch.device) -> StepInputs:
    """Any step's inputs: ``num_scheduled_by_id`` tokens of each of ``rows`` (sorted)."""
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

    to_device = _device_copier(device)
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


def _decode_step_inputs(batch: InputBatch, rows: np.ndarray, device: torch.device) -> StepInputs:
    """``build_step_inputs`` for a step of one token per scheduled row (every decode step):
    the same inputs, without the per-token gathers a step of longer queries needs, since
    token ``i`` is row ``i``'s only one, at position ``num_computed_tokens``. At small
    batches a step's fixed cost is these numpy calls (tests/test_step_overhead.py checks
    the two builders agree)."""
    num_reqs = len(rows)
    block_size = batch.block_size
    context_lens = batch.num_computed_tokens[rows]
    seq_lens = context_lens + 1
    query_start = np.arange(num_reqs + 1, dtype=np.int64)
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    slot_mapping = batch.block_table[rows, context_lens // block_size] * block_size + context_lens % block_size
    to_device = _device_copier(device)
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=max_seq_len,
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
        num_scheduled=np.ones(num_reqs, dtype=np.int64),
        query_start=query_start,
        context_lens=context_lens,
        sample_mask=seq_lens >= batch.num_tokens[rows],
        input_ids=to_device(batch.token_ids[rows, context_lens]),
        positions=to_device(context_lens.copy()),  # its own tensor, as the general builder's
        metadata=metadata,
    )


def _device_copier(device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    """numpy array -> tensor on ``device`` (on the host: the array's memory itself)."""
    if device == _HOST:  # torch.from_numpy tensors live where numpy does; a no-op .to() still dispatches
        return _host_tensor
    # A copy from pageable memory is synchronous whatever non_blocking says; from pinned memory
    # (torch's caching host allocator, which keeps the block until the copy is done) it is not.
    pin = device.type == "cuda"

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = _host_tensor(array)
        return (tensor.pin_memory() if pin else tensor).to(device, non_blocking=True)

    return to_device


def _host_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))
