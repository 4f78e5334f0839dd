"""Showing a result: a rich table for people, ``--output-json`` for machines.

A result is one flat dict with ``vllm bench``'s key names; the table reads
from it, so what is printed and what is saved never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill_cli.bench.metrics import percentile_key

# (label, key, format); rows whose key is missing or None are skipped
Row = tuple[str, str, str]

LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency", "latency": "Iteration latency"}


def _format(value: Any, fmt: str) -> str:
    if isinstance(value, float | int) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def summary_table(title: str, result: dict[str, Any], rows: Sequence[Row]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, key, fmt in rows:
        if result.get(key) is not None:
            table.add_row(label, _format(result[key], fmt))
    return table


def latency_table(result: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]) -> Table:
    """One row per latency metric: mean, median and each percentile, in ms."""
    stats = ["mean", "median", *[percentile_key(p) for p in percentiles]]
    table = Table(title="Latency (ms)", title_justify="left")
    table.add_column("metric", style="bold")
    for stat in stats:
        table.add_column(stat.replace("_", "."), justify="right")
    for metric in metrics:
        if f"mean_{metric}_ms" in result:
            table.add_row(LATENCY_LABELS.get(metric, metric),
                          *[_format(result.get(f"{stat}_{metric}_ms", 0.0), ".2f") for stat in stats])
    return table


def print_tables(*tables: Table, console: Console | None = None) -> None:
    console = console or Console()
    for table in tables:
        console.print(table)


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
