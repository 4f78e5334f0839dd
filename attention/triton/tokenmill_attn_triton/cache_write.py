"""The KV-cache write kernel: each new token's keys and values into its slot.

One program per token copies all its KV heads (``[H_kv, D]``) to slot
``slot_mapping[t]`` of the flattened ``[blocks * block_size]`` cache; a negative
slot (a padding token) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, num_kv_heads, head_size,
              stride_kt, stride_kh, stride_vt, stride_vh,
              stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
              block_size: tl.constexpr, heads_pad: tl.constexpr, head_pad: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, heads_pad)
    dims = tl.arange(0, head_pad)
    # the slot test as a full block: the interpreter's masked load rejects a broadcast scalar
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size) & (heads[:, None] * 0 + slot >= 0)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :],
             key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
             + dims[None, :], value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``key``/``value`` [T, H_kv, D] into the caches [blocks, block_size, H_kv, D] at
    ``slot_mapping`` [T]. Last dimensions must be contiguous."""
    tokens, num_kv_heads, head_size = key.shape
    if tokens == 0:
        return
    _write_kv[(tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_size=key_cache.shape[1], heads_pad=triton.next_power_of_2(num_kv_heads),
        head_pad=triton.next_power_of_2(head_size),
    )
