"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's KV depends on every token before it (causal attention), so a block's
hash chains its parent's hash with its own tokens. Two blocks with the same
hash therefore hold the same KV, whichever request computed them.

The hash must be identical across processes and restarts (several engine
processes, or a cache that outlives one), so it is a sha256 over a fixed byte
encoding, never Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from tokenmill.request import BlockHash, Request

# Stands in for the parent of a sequence's first block, so a first block and a
# later block with the same tokens never share a hash.
_ROOT_PARENT = b"tokenmill-kv-root-v1"

# Tags of the extra keys, so a salt "x" never collides with a LoRA named "x".
LORA_KEY = "lora"
MM_KEY = "mm"
SALT_KEY = "salt"


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None,
) -> BlockHash:
    """The chained hash of one block: parent hash, token ids, extra keys."""
    digest = hashlib.sha256()
    digest.update(_length_prefixed(_ROOT_PARENT if parent is None else b"P" + parent))
    digest.update(_length_prefixed(struct.pack(f"<{len(token_ids)}q", *token_ids)))
    digest.update(_encode_key(extra_keys))
    return BlockHash(digest.digest())


def _length_prefixed(data: bytes) -> bytes:
    """``data`` preceded by its length, so adjacent fields cannot run together."""
    return struct.pack("<Q", len(data)) + data


def _encode_key(key: Any) -> bytes:
    """A stable, unambiguous byte encoding of an extra key.

    Only plain values are accepted: anything else (an object whose ``repr``
    holds a memory address, say) would make the hash differ between
    processes, so it raises ``TypeError`` instead.
    """
    if key is None:
        return b"N"
    if isinstance(key, bool):  # before int: bool is an int subclass
        return b"B" + (b"\x01" if key else b"\x00")
    if isinstance(key, int):
        return b"I" + _length_prefixed(str(key).encode())
    if isinstance(key, float):
        return b"F" + struct.pack("<d", key)
    if isinstance(key, str):
        return b"S" + _length_prefixed(key.encode("utf-8"))
    if isinstance(key, bytes):
        return b"Y" + _length_prefixed(key)
    if isinstance(key, (tuple, list)):
        return b"T" + struct.pack("<Q", len(key)) + b"".join(_encode_key(k) for k in key)
    raise TypeError(f"cannot hash an extra key of type {type(key).__name__}")


def block_extra_keys(request: Request, start: int, end: int) -> tuple | None:
    """What besides tokens decides the KV of the block over positions [start, end).

    The LoRA adapter changes every block's KV (keyed by its content: its name alone could
    be re-registered with other weights, and the hash is known before the request is ever
    scheduled, since it waits for its adapter to load); a multimodal item changes the
    KV of the blocks its placeholder tokens overlap (the placeholder token ids
    alone do not say which image it was); the cache salt isolates tenants,
    and since every later hash chains through the first block, salting the
    first block is enough. Each key is a ``(tag, value)`` pair.
    """
    keys: list[tuple[str, str]] = []
    if request.lora_name is not None:
        keys.append((LORA_KEY, request.lora_content_hash or request.lora_name))
    for offset, length, mm_hash in request.mm_hashes:
        if offset < end and offset + length > start:
            keys.append((MM_KEY, mm_hash))
    if start == 0 and request.cache_salt is not None:
        keys.append((SALT_KEY, request.cache_salt))
    return tuple(keys) if keys else None


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend ``request.block_hashes`` over the full blocks not hashed yet.

    Incremental: called every step, it hashes only the blocks that became
    full since the last call. A request must always be hashed with the same
    ``block_size``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_hashed = len(request.block_hashes)
    num_full = request.num_tokens // block_size
    if num_full <= num_hashed:
        return
    tokens = _tokens_between(request, num_hashed * block_size, num_full * block_size)
    parent = request.block_hashes[-1] if num_hashed else None
    for index in range(num_hashed, num_full):
        start = index * block_size
        offset = start - num_hashed * block_size
        block_tokens = tokens[offset:offset + block_size]
        parent = hash_block_tokens(parent, block_tokens, block_extra_keys(request, start, start + block_size))
        request.block_hashes.append(parent)


def _tokens_between(request: Request, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end), without copying the whole sequence."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt:
        return output[start - num_prompt:end - num_prompt]
    return prompt[start:] + output[:end - num_prompt]
