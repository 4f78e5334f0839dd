"""Tile configs for the Triton fused MoE: a small table keyed by the layer's shape, its
weights' dtype and the device, written by ``scripts/tune-fused-moe.py``.

The table (``fused_moe_configs.json`` beside this file) maps a key
``E=<experts>,H=<hidden>,I=<intermediate>,dtype=<weight dtype>,device=<GPU name>`` to
token-count buckets: ``{"<max tokens>": {"block_m": .., "block_n": .., "block_k": ..,
"num_warps": .., "num_stages": ..}}``. A step of ``tokens`` rows takes the config of the
smallest bucket at or above it (the largest bucket past them all). A shape the table does
not hold gets a default chosen by size: the row block follows the mean rows per expert
(few rows: small blocks, less padding; many: larger, more reuse of each weight tile).

No triton import here: the table logic is tested without a GPU or the interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("fused_moe_configs.json")
Table = dict[str, dict[str, dict[str, int]]]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def as_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> TileConfig:
        return cls(**{field.name: int(fields[field.name]) for field in dataclasses.fields(cls) if field.name in fields})


def device_label(name: str) -> str:
    """A GPU's name as the table keys it (``NVIDIA H200`` -> ``NVIDIA_H200``)."""
    return "_".join(name.split())


def table_key(num_experts: int, hidden: int, intermediate: int, dtype: str, device: str) -> str:
    """``intermediate`` is one expert's (per rank under tensor parallelism); ``dtype`` the
    weights' (``bfloat16``, ``float8_e4m3fn``, ``int8``)."""
    return f"E={num_experts},H={hidden},I={intermediate},dtype={dtype},device={device_label(device)}"


def default_config(tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """By size: the row block near the mean rows an expert gets (16 to 64)."""
    rows_per_expert = tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def choose_config(table: Mapping[str, Mapping[str, Mapping[str, int]]], key: str, tokens: int, top_k: int,
                  num_experts: int) -> TileConfig:
    """The table's config for ``key`` at ``tokens`` rows, else :func:`default_config`."""
    buckets = table.get(key)
    if not buckets:
        return default_config(tokens, top_k, num_experts)
    sizes = sorted(int(size) for size in buckets)
    chosen = next((size for size in sizes if size >= tokens), sizes[-1])
    return TileConfig.from_json(buckets[str(chosen)])


def with_entry(table: Mapping[str, Mapping[str, Mapping[str, int]]], key: str, tokens: int,
               config: TileConfig) -> Table:
    """A copy of ``table`` with ``config`` for ``key`` at the bucket ``tokens`` (replacing one there)."""
    updated: Table = {name: {size: dict(fields) for size, fields in buckets.items()} for name, buckets in table.items()}
    updated.setdefault(key, {})[str(tokens)] = config.as_json()
    return updated


def candidate_configs() -> list[TileConfig]:
    """What the tuning script times: row blocks 16-128, column blocks 32-128, depth 32-128,
    4 or 8 warps, 2-4 stages (the product pruned of 128x128x128 tiles, which spill)."""
    return [TileConfig(block_m, block_n, block_k, warps, stages)
            for block_m in (16, 32, 64, 128) for block_n in (32, 64, 128) for block_k in (32, 64, 128)
            for warps in (4, 8) for stages in (2, 3, 4)
            if not (block_m == block_n == block_k == 128)]


def fastest(timings: Mapping[TileConfig, float]) -> TileConfig:
    """The config of the least time (ties to the first timed); refuses an empty set."""
    if not timings:
        raise ValueError("no config ran: every candidate failed")
    return min(timings, key=lambda config: timings[config])


def read_table(path: Path = TABLE_PATH) -> Table:
    return json.loads(path.read_text()) if path.exists() else {}


def write_table(table: Mapping[str, Mapping[str, Mapping[str, int]]], path: Path = TABLE_PATH) -> None:
    """Keys and buckets in order (by bucket size), so that a re-tune diffs line by line."""
    ordered = {key: {size: dict(table[key][size]) for size in sorted(table[key], key=int)} for key in sorted(table)}
    path.write_text(json.dumps(ordered, indent=1) + "\n")


@functools.cache
def packaged_table() -> Table:
    """The table shipped in the package, read once per process."""
    return read_table(TABLE_PATH)
