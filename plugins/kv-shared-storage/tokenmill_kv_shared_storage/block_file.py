"""One KV block on disk: a small header, then the block's keys and values of every layer.

Layout: the magic line ``TMKV1\\n``, a 4-byte little-endian header length, the JSON header
(``dtype``, per-layer ``[block_size, num_kv_heads, head_size]`` shapes, payload ``nbytes`` and
its BLAKE2b ``digest``), then the payload: layer by layer, the block's keys then its values, as
the paged cache holds them. A file is written to a temporary name and renamed, so a reader
never sees half of one; a reader still checks size and digest (a shared filesystem, a disk,
or a hand may damage it) and the layout (another model's folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch

MAGIC = b"TMKV1\n"
_LENGTH = struct.Struct("<I")


class BadBlockFile(Exception):
    """A block file that is missing, truncated, corrupt, or of another layout."""


def _digest(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    return [list(keys.shape[1:]) for keys, _values in kv_caches]


def gather_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int) -> bytes:
    """The payload of block ``block_id``: its keys and values of every layer, on the host."""
    parts = [t[block_id].reshape(-1) for cache in kv_caches for t in cache]
    return torch.cat(parts).cpu().view(torch.uint8).numpy().tobytes()


def write_block(path: Path, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int) -> int:
    """Write block ``block_id`` to ``path`` (atomically); returns the bytes written."""
    payload = gather_block(kv_caches, block_id)
    header = json.dumps({"dtype": str(kv_caches[0][0].dtype).removeprefix("torch."), "layout": _layout(kv_caches),
                         "nbytes": len(payload), "digest": _digest(payload)}).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(MAGIC) + _LENGTH.size + len(header) + len(payload)


def read_block(path: Path, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The checked payload of ``path`` as a flat tensor of the caches' dtype (on the host);
    :class:`BadBlockFile` if it is missing, short, corrupt or not this cache's layout."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadBlockFile(f"{path.name}: cannot be read ({exc})") from exc
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or not data.startswith(MAGIC):
        raise BadBlockFile(f"{path.name}: not a KV block file")
    (header_len,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start : start + header_len])
    except ValueError as exc:
        raise BadBlockFile(f"{path.name}: unreadable header") from exc
    dtype = kv_caches[0][0].dtype
    if header.get("dtype") != str(dtype).removeprefix("torch.") or header.get("layout") != _layout(kv_caches):
        raise BadBlockFile(f"{path.name}: written for another KV layout ({header.get('dtype')}, {header.get('layout')})")
    payload = memoryview(data)[start + header_len :]
    if len(payload) != header.get("nbytes"):
        raise BadBlockFile(f"{path.name}: truncated ({len(payload)} of {header.get('nbytes')} payload bytes)")
    if _digest(payload) != header.get("digest"):
        raise BadBlockFile(f"{path.name}: checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=dtype)


def scatter_block(payload: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int) -> None:
    """Copy a payload from :func:`read_block` into block ``block_id`` of every layer."""
    offset = 0
    for cache in kv_caches:
        for tensor in cache:
            target = tensor[block_id]
            target.copy_(payload[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
