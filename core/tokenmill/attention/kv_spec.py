"""What one attention layer keeps per token in the paged KV cache: its kind, shape and bytes.

Every layer the model runner binds (``tokenmill.layers.Attention`` and its subclasses) says
through its ``kv_cache_spec`` what it caches, and the runner allocates the cache, counts its
bytes per block (which sets how many blocks a memory budget buys) and builds the memory
profiler's scratch cache from that alone. Two kinds:

- ``"kv"``: a key and a value tensor, each ``[num_blocks, block_size, num_heads, head_size]``;
  every ordinary attention layer, whose backend writes and reads them.
- ``"latent"``: one tensor ``[num_blocks, block_size, num_heads, head_size]`` (one "head" in
  practice) holding a token's whole entry: DeepSeek's multi-head latent attention caches the
  normed latent followed by the rotary key shared by all heads (``kv_lora_rank +
  qk_rope_head_dim`` numbers a token, against ``2 * heads * head_size`` for keys and values),
  and each head's value is the entry's latent part. The layer is bound to the pair ``(entry,
  entry)``, the same tensor as key and value, so whatever walks a layer's K/V pair (a KV
  connector, the prefault) still works; its bytes are counted once. Such a layer writes and
  reads its cache itself (:mod:`tokenmill.attention.latent`), not through the attention backend.

The block pool and the scheduler see blocks only, so prefix caching, chunked prefill and
preemption work the same for both kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

KVCacheKind = Literal["kv", "latent"]
# what makes one zero-filled cache tensor: (shape, dtype) -> tensor (a platform's KVCacheAllocator)
TensorAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache: ``kind``, and the heads and head size of each of its tensors."""

    kind: KVCacheKind
    num_heads: int
    head_size: int

    @property
    def num_tensors(self) -> int:
        """Tensors a layer of this kind allocates: K and V, or the one latent entry."""
        return 1 if self.kind == "latent" else 2

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_heads, self.head_size)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.num_tensors * self.num_heads * self.head_size * element

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)

    def allocate(self, allocate: TensorAllocator, num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(K, V)`` pair; for a latent layer one tensor, in both places."""
        shape = self.page_shape(num_blocks, block_size)
        if self.kind == "latent":
            entry = allocate(shape, dtype)
            return entry, entry
        return allocate(shape, dtype), allocate(shape, dtype)
