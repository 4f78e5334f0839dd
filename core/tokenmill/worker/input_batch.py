"""The persistent batch: one row per running request, kept across steps.

Rows are updated from the scheduler's diffs (new requests, new blocks,
finished or preempted ones) instead of being rebuilt every step; token ids
and block tables live in numpy arrays so a step's inputs are a few
vectorised gathers. Removing a request moves the last row into its hole, so
rows ``0 .. num_reqs-1`` are always the live ones.
"""

from __future__ import annotations

import numpy as np

from tokenmill.worker.request_state import CachedRequestState


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Per-row flags for the rare requests that need extra work in a step, so the step
        # finds them with one mask instead of asking every request.
        self.is_pooling = np.zeros(max_num_reqs, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.samples_nothing = np.zeros(max_num_reqs, dtype=bool)  # pooling, or max_tokens 0: prefill only
        # How many live rows carry each flag: a step whose batch has none (most steps) skips
        # that flag's work without a look at the arrays.
        self.num_pooling = 0
        self.num_prompt_logprobs = 0
        self.num_samples_nothing = 0
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.index_of: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState) -> None:
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch full ({self.max_num_reqs} rows)")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.index_of[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.is_pooling[row], self.wants_prompt_logprobs[row], self.samples_nothing[row] = _flags(state)
        self._count_flags(state, 1)
        self.set_blocks(row, state.block_ids)

    def remove(self, req_id: str) -> None:
        row = self.index_of.pop(req_id, None)
        if row is None:
            return
        self._count_flags(self.states[row], -1)
        last = self.num_reqs - 1
        if row != last:
            self._move(last, row)
        self.req_ids.pop()
        self.states.pop()

    def _count_flags(self, state: CachedRequestState, sign: int) -> None:
        pooling, prompt_logprobs, samples_nothing = _flags(state)
        self.num_pooling += sign * pooling
        self.num_prompt_logprobs += sign * prompt_logprobs
        self.num_samples_nothing += sign * samples_nothing

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for array in (self.num_tokens, self.num_computed_tokens, self.num_blocks, self.is_pooling,
                      self.wants_prompt_logprobs, self.samples_nothing):
            array[dst] = array[src]
        self.block_table[dst, : self.num_blocks[src]] = self.block_table[src, : self.num_blocks[src]]
        self.req_ids[dst], self.states[dst] = self.req_ids[src], self.states[src]
        self.index_of[self.req_ids[dst]] = dst

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def truncate_blocks(self, row: int, num_blocks: int) -> None:
        """Keep the row's first ``num_blocks`` blocks (the scheduler gave back the others)."""
        self.num_blocks[row] = min(int(self.num_blocks[row]), num_blocks)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1


def _flags(state: CachedRequestState) -> tuple[bool, bool, bool]:
    """A request's rare-work flags: pooling, prompt logprobs, samples nothing (pooling, or
    max_tokens 0: prefill only)."""
    pooling = state.pooling is not None
    return (pooling, state.sampling_params.prompt_logprobs is not None,
            pooling or state.sampling_params.max_tokens == 0)
