"""The messages between a consumer and a producer.

A consumer sends ``[b"FETCH", {"hashes": [...]}]`` (JSON) on a DEALER socket; the producer's
ROUTER answers ``[b"MISSING", {}]`` when it does not hold every one of those blocks, or
``[b"KV", header, *frames]``: the header (JSON) gives the KV ``dtype``, the per-layer
``layout`` and each block's ``hash`` and BLAKE2b ``digest``; then two frames (keys, values) per
layer per block, in that order, each exactly as the paged cache holds that block (so a producer
on the CPU sends them without a copy). A consumer checks everything before a byte reaches its
cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

FETCH, KV, MISSING = b"FETCH", b"KV", b"MISSING"

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class BadPayload(Exception):
    """An answer that does not carry exactly the blocks asked for, intact."""


def layout(kv_caches: KVCaches) -> list[list[int]]:
    return [list(keys.shape[1:]) for keys, _values in kv_caches]


def dtype_name(kv_caches: KVCaches) -> str:
    return str(kv_caches[0][0].dtype).removeprefix("torch.")


def block_frames(kv_caches: KVCaches, block_id: int) -> list[memoryview]:
    """Block ``block_id`` of every layer, keys then values: views of the cache on the CPU."""
    frames = []
    for cache in kv_caches:
        for tensor in cache:
            host = tensor[block_id].cpu()  # the same memory on the CPU, a copy from a device
            frames.append(memoryview(host.view(torch.uint8).numpy().reshape(-1)))  # type: ignore[arg-type]
    return frames


def digest(frames: Sequence[memoryview | bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for frame in frames:
        h.update(frame)
    return h.hexdigest()


def kv_reply(kv_caches: KVCaches, hashes: list[str], block_ids: list[int]) -> list[Any]:
    """``[KV, header, *frames]`` for these blocks."""
    per_block = [block_frames(kv_caches, block_id) for block_id in block_ids]
    header = {"dtype": dtype_name(kv_caches), "layout": layout(kv_caches),
              "blocks": [{"hash": h, "digest": digest(frames)} for h, frames in zip(hashes, per_block, strict=True)]}
    return [KV, json.dumps(header).encode(), *[frame for frames in per_block for frame in frames]]


def read_kv_reply(parts: list[bytes], kv_caches: KVCaches, hashes: list[str]) -> list[list[bytes]]:
    """The frames of each asked block, in order, checked; :class:`BadPayload` otherwise."""
    if not parts or parts[0] != KV:
        raise BadPayload(f"answer {parts[0][:16]!r}" if parts else "an empty answer")
    try:
        header = json.loads(parts[1])
    except (IndexError, ValueError) as exc:
        raise BadPayload("unreadable header") from exc
    if header.get("dtype") != dtype_name(kv_caches) or header.get("layout") != layout(kv_caches):
        raise BadPayload(f"another KV layout ({header.get('dtype')}, {header.get('layout')})")
    blocks = header.get("blocks") or []
    if [b.get("hash") for b in blocks] != hashes:
        raise BadPayload("not the blocks asked for")
    frames_per_block = 2 * len(kv_caches)
    frames = parts[2:]
    if len(frames) != frames_per_block * len(hashes):
        raise BadPayload(f"{len(frames)} frames for {len(hashes)} blocks of {frames_per_block}")
    sizes = [t[0].numel() * t.element_size() for cache in kv_caches for t in cache]
    result = []
    for index, block in enumerate(blocks):
        mine = frames[index * frames_per_block : (index + 1) * frames_per_block]
        if [len(f) for f in mine] != sizes:
            raise BadPayload(f"block {block['hash'][:16]}: truncated or padded")
        if digest(mine) != block.get("digest"):
            raise BadPayload(f"block {block['hash'][:16]}: checksum mismatch")
        result.append(mine)
    return result


def scatter(frames: list[bytes], kv_caches: KVCaches, block_id: int) -> None:
    """Copy one block's checked frames into block ``block_id`` of every layer."""
    targets = [tensor[block_id] for cache in kv_caches for tensor in cache]
    for frame, target in zip(frames, targets, strict=True):
        source = torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(target.dtype).view(target.shape)
        target.copy_(source)
