"""What the scheduler half tells the worker half each step, and where a block's file lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BlockRef = tuple[int, str]  # (block id in the paged cache, the block's prefix-cache hash in hex)

SUFFIX = ".kvb"


@dataclass
class SharedStorageMetadata:
    """``loads``: per request, the blocks to fill from their files (all or nothing: a request
    whose files do not all check out is reported failed). ``saves``: blocks whose KV this step
    completes, to write unless their file exists. ``cancelled``: requests that ended or were
    preempted since the last step: a load still running for one is dropped."""

    loads: dict[str, list[BlockRef]] = field(default_factory=dict)
    saves: list[BlockRef] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)


def storage_folder(extra_config: dict[str, Any]) -> Path:
    """The folder ``kv_connector_extra_config["shared_storage_path"]`` names (vLLM's key), created."""
    path = extra_config.get("shared_storage_path")
    if not path:
        raise ValueError("kv_shared_storage needs kv_connector_extra_config={'shared_storage_path': FOLDER}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def block_file(folder: Path, block_hash_hex: str, rank: int = 0, num_ranks: int = 1) -> Path:
    """One rank's file of a block: ``HASH.kvb``, or under tensor parallelism ``HASH.tpN.rR.kvb``
    (each rank holds its own KV heads; engines of another tensor-parallel size find none)."""
    if num_ranks == 1:
        return folder / f"{block_hash_hex}{SUFFIX}"
    return folder / f"{block_hash_hex}.tp{num_ranks}.r{rank}{SUFFIX}"
