"""The messages between a consumer and a producer: one prompt's KV, layer by layer.

A consumer sends ``[b"FETCH", {"hashes": [...], "request_id": ...}]`` (JSON) on a DEALER socket.
The producer's ROUTER answers ``[b"MISSING", {}]`` when it does not hold every one of those
blocks; else a header ``[b"KV", {...}]`` (JSON: the KV ``dtype``, the per-layer ``layout``, the
blocks' ``hashes`` and ``runs``, the lengths of the runs of consecutive block ids the producer's
blocks fall into) and then one message per attention layer, in order: ``[b"LAYER", {"layer": i,
"digest": ...}, *keys, *values]``, one frame of keys and one of values per run, each exactly the
bytes of those consecutive blocks in the paged cache (so a producer on the CPU sends views of its
cache, no copy) and a BLAKE2b digest over the layer's frames.

A consumer checks each layer (its index, its frames' sizes, its digest) before a byte of it
reaches the cache, and copies it into its own blocks straight from the frame zmq received it in,
while zmq receives the next layer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
import zmq

FETCH, KV, LAYER, MISSING = b"FETCH", b"KV", b"LAYER", b"MISSING"

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class BadPayload(Exception):
    """An answer that does not carry exactly the blocks asked for, intact."""


def layout(kv_caches: KVCaches) -> list[list[int]]:
    return [list(keys.shape[1:]) for keys, _values in kv_caches]


def dtype_name(kv_caches: KVCaches) -> str:
    return str(kv_caches[0][0].dtype).removeprefix("torch.")


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first id, length)`` of each run of consecutive ids, in order: each run is one
    contiguous slice of a cache tensor."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def digest(frames: Sequence[memoryview | bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for frame in frames:
        h.update(frame)  # hashlib lets go of the GIL over big buffers: the forward runs on meanwhile
    return h.hexdigest()


# -- the producer's side ---------------------------------------------------------


def kv_header(kv_caches: KVCaches, hashes: list[str], runs: list[tuple[int, int]]) -> list[bytes]:
    header = {"dtype": dtype_name(kv_caches), "layout": layout(kv_caches), "hashes": hashes,
              "runs": [length for _first, length in runs]}
    return [KV, json.dumps(header).encode()]


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous slice of the cache as bytes: a view on the CPU, a copy from a device."""
    host = tensor.cpu()
    return memoryview(host.view(torch.uint8).numpy().reshape(-1))  # type: ignore[arg-type]


def layer_message(kv_caches: KVCaches, layer: int, runs: list[tuple[int, int]]) -> list[Any]:
    """``[LAYER, header, *keys, *values]`` of layer ``layer``'s blocks (``runs`` of them)."""
    with torch.inference_mode():  # the cache may be an inference tensor; this thread is outside the forward's mode
        frames = [_host_bytes(tensor[first:first + length]) for tensor in kv_caches[layer] for first, length in runs]
    header = {"layer": layer, "digest": digest(frames)}
    return [LAYER, json.dumps(header).encode(), *frames]


# -- the consumer's side ---------------------------------------------------------


def read_header(parts: Sequence[zmq.Frame], kv_caches: KVCaches, hashes: list[str]) -> list[int]:
    """The run lengths of a ``KV`` header that announces exactly the blocks asked for, in this
    engine's KV layout; :class:`BadPayload` otherwise."""
    if len(parts) != 2 or parts[0].bytes != KV:
        raise BadPayload(f"answer {parts[0].bytes[:16]!r}" if parts else "an empty answer")
    try:
        header = json.loads(parts[1].bytes)
        runs = [int(n) for n in header["runs"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadPayload("unreadable header") from exc
    if header.get("dtype") != dtype_name(kv_caches) or header.get("layout") != layout(kv_caches):
        raise BadPayload(f"another KV layout ({header.get('dtype')}, {header.get('layout')})")
    if header.get("hashes") != hashes:
        raise BadPayload("not the blocks asked for")
    if any(n <= 0 for n in runs) or sum(runs) != len(hashes):
        raise BadPayload(f"runs {runs} for {len(hashes)} blocks")
    return runs


def read_layer(parts: Sequence[zmq.Frame], kv_caches: KVCaches, layer: int, runs: list[int]) -> list[zmq.Frame]:
    """The checked key and value frames of layer ``layer``; :class:`BadPayload` for another layer,
    a missing, short or padded frame, or a checksum mismatch."""
    if len(parts) < 2 or parts[0].bytes != LAYER:
        raise BadPayload(f"answer {parts[0].bytes[:16]!r} where layer {layer} was due" if parts else "an empty answer")
    try:
        header = json.loads(parts[1].bytes)
        index, expected_digest = int(header["layer"]), str(header["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadPayload(f"layer {layer}: unreadable header") from exc
    if index != layer:
        raise BadPayload(f"layer {index} where layer {layer} was due")
    frames = list(parts[2:])
    sizes = [n * tensor[0].nbytes for tensor in kv_caches[layer] for n in runs]
    if [len(frame.buffer) for frame in frames] != sizes:
        raise BadPayload(f"layer {layer}: {len(frames)} frames, truncated, padded or missing")
    if digest([frame.buffer for frame in frames]) != expected_digest:
        raise BadPayload(f"layer {layer}: checksum mismatch")
    return frames


def copy_layer(frames: Sequence[zmq.Frame], kv_cache: tuple[torch.Tensor, torch.Tensor], runs: list[int],
               block_ids: list[int]) -> None:
    """Copy one layer's checked frames into blocks ``block_ids`` (in the hashes' order), straight
    from the buffers zmq received them in: one copy, by runs of consecutive blocks."""
    frames_of = {0: frames[:len(runs)], 1: frames[len(runs):]}
    with torch.inference_mode():
        for kind, tensor in enumerate(kv_cache):
            offset = 0
            for length, frame in zip(runs, frames_of[kind], strict=True):
                source = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(tensor.dtype)
                source = source.view(length, *tensor.shape[1:])
                _write_blocks(tensor, block_ids[offset:offset + length], source)
                offset += length


def _write_blocks(tensor: torch.Tensor, block_ids: list[int], source: torch.Tensor) -> None:
    position = 0
    for first, length in block_runs(block_ids):
        tensor[first:first + length].copy_(source[position:position + length])
        position += length
