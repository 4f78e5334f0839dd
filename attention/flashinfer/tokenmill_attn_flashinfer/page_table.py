"""FlashInfer's page table, built from tokenmill's per-step metadata.

FlashInfer reads a batch's KV pages as a CSR list: ``indptr[i]:indptr[i+1]`` of
``indices`` are request ``i``'s pages in order, and ``last_page_len[i]`` how many
tokens of its last page are filled. tokenmill's block table is a padded
``[requests, max_blocks]`` matrix; the pages a request uses are the first
``ceil(seq_len / block_size)`` of its row. The positions to keep are computed on the
host from the CPU copy of the sequence lengths (no device synchronisation), then one
``index_select`` gathers them on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PageTable:
    qo_indptr_host: torch.Tensor  # [num_reqs + 1] int32, on the host (plan reads it there)
    kv_indptr_host: torch.Tensor  # [num_reqs + 1] int32, host
    last_page_len_host: torch.Tensor  # [num_reqs] int32, host
    kv_indices: torch.Tensor  # [total pages] int32, on the device


def build_page_table(query_start_loc_cpu: np.ndarray, seq_lens_cpu: np.ndarray, block_table: torch.Tensor,
                     block_size: int) -> PageTable:
    seq_lens = np.asarray(seq_lens_cpu, dtype=np.int64)
    pages = (seq_lens + block_size - 1) // block_size
    kv_indptr = np.zeros(len(pages) + 1, dtype=np.int64)
    np.cumsum(pages, out=kv_indptr[1:])
    # the flat position (row * max_blocks + column) of every page in use, row after row
    rows = np.repeat(np.arange(len(pages)), pages)
    columns = np.arange(int(kv_indptr[-1])) - np.repeat(kv_indptr[:-1], pages)
    flat = torch.from_numpy(rows * block_table.shape[1] + columns).to(block_table.device, non_blocking=True)
    last_page_len = seq_lens - (pages - 1) * block_size
    return PageTable(
        qo_indptr_host=torch.from_numpy(np.asarray(query_start_loc_cpu, dtype=np.int32)),
        kv_indptr_host=torch.from_numpy(kv_indptr.astype(np.int32)),
        last_page_len_host=torch.from_numpy(last_page_len.astype(np.int32)),
        kv_indices=block_table.reshape(-1).index_select(0, flat).to(torch.int32),
    )
