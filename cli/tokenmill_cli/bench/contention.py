"""The contention benchmark's report: the figures of a run beside busy neighbours, each over the
same figure of the quiet run before it (see :mod:`.background_load`)."""

from __future__ import annotations

from typing import Any

from tokenmill_cli.bench.report import Row

# What a loaded run is judged by: throughput (higher is better) and per-token latency (lower).
FIGURES = ("total_token_throughput", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
           "avg_latency")

CONTENTION_ROWS: list[Row] = [
    ("Background load (busy processes)", "background_load", "d"),
    ("Background kind", "background_kind", ""),
    ("Quiet total token throughput (tok/s)", "quiet_total_token_throughput", ".1f"),
    ("Loaded / quiet total throughput", "relative_total_token_throughput", ".1%"),
    ("Quiet mean TPOT (ms)", "quiet_mean_tpot_ms", ".2f"),
    ("Loaded / quiet mean TPOT", "relative_mean_tpot_ms", ".2f"),
    ("Quiet average latency (s)", "quiet_avg_latency", ".3f"),
    ("Loaded / quiet average latency", "relative_avg_latency", ".2f"),
]


def result_figures(result: dict[str, Any]) -> dict[str, float | None]:
    return {key: result.get(key) for key in FIGURES if key in result}


def contention_json(count: int, kind: str, loaded: dict[str, float | None],
                    quiet: dict[str, Any] | None) -> dict[str, Any]:
    """``background_load``/``background_kind``, and where a quiet run came first, ``quiet_<figure>``
    and ``relative_<figure>`` (loaded over quiet) for each figure."""
    out: dict[str, Any] = {"background_load": count or None, "background_kind": kind if count else None}
    if quiet is None:
        return out
    for key, value in loaded.items():
        base = quiet.get(key)
        out[f"quiet_{key}"] = base
        out[f"relative_{key}"] = value / base if value is not None and base else None
    return out
