"""What structured decoding costs: the same throughput workload with and without a constraint.

Each kind is one fixed constraint (``--structured-output KIND``) applied to every request.
The JSON schema, regex and grammar have no short sentences (their minimum repetitions run to
hundreds of characters), so every request runs to its ``output_len`` exactly as unconstrained
ones do: the two workloads generate the same tokens in the same batches. ``choice`` ends after
a few tokens, so its figure is mostly prefill. The grammar is compiled by an untimed warm-up request (it is cached for
the others), so the figures are the per-token cost: bitmask filling and applying, and the
matcher advancing.

``--compare-structured`` runs the workload unconstrained and constrained in one process,
alternating the order each round (the first run of a pair can warm caches for the second),
and reports the median and the spread of the rounds: on a shared machine one pair is noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tokenmill_cli.bench.datasets import BenchRequest
from tokenmill_cli.bench.metrics import RequestRecord, compute_metrics
from tokenmill_cli.bench.report import Row, print_tables, summary_table

# An order list: objects of a few typed fields, as many as the model writes.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {"type": "array", "minItems": 16, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "quantity": {"type": "integer", "minimum": 1},
                           "price": {"type": "number"},
                           "gift": {"type": "boolean"}},
            "required": ["sku", "quantity", "price", "gift"]}},
    },
    "required": ["customer", "items"],
}

CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json-schema": {"json": ORDER_SCHEMA},
    "regex": {"regex": r"([a-z]{1,12} [0-9]{1,4}(, | and )){64,}"},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed feelings"]},
    "grammar": {"grammar": 'root ::= line{64,}\nline ::= word (" " word)* ".\\n"\nword ::= [a-z]+ | [0-9]+'},
}
KINDS = ("none", *CONSTRAINTS)


def constraint_of(kind: str) -> dict[str, Any] | None:
    if kind not in KINDS:
        raise ValueError(f"unknown --structured-output {kind!r}; choose from {', '.join(KINDS)}")
    return CONSTRAINTS.get(kind)


def constrain(requests: Sequence[BenchRequest], kind: str) -> list[BenchRequest]:
    constraint = constraint_of(kind)
    return [replace(r, structured_outputs=constraint) for r in requests]


def compile_grammar(backend: Any, requests: Sequence[BenchRequest], temperature: float) -> None:
    """One short constrained request, untimed: the grammar compiles once and is cached for the rest."""
    if requests and requests[0].structured_outputs is not None:
        backend.run([replace(requests[0], output_len=2)], temperature)


def ms_per_output_token(duration_s: float, records: Sequence[RequestRecord]) -> float | None:
    """Wall time over every token generated: the batch's cost of one more output token."""
    tokens = sum(r.output_len for r in records if r.ok)
    return 1000 * duration_s / tokens if tokens else None


def timed_pass(backend: Any, requests: Sequence[BenchRequest], temperature: float) -> dict[str, float | None]:
    """Wall time, and this process's CPU time: on a machine shared with other work the wall clock
    also counts the time other processes held the cores; CPU time counts only ours."""
    start, cpu_start = time.perf_counter(), time.process_time()
    records = backend.run(requests, temperature)
    duration, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    metrics = compute_metrics(records, duration, ()).as_json()
    return {"ms_per_output_token": ms_per_output_token(duration, records),
            "cpu_ms_per_output_token": ms_per_output_token(cpu, records), "mean_tpot_ms": metrics["mean_tpot_ms"],
            "output_tokens": metrics["total_output_tokens"], "duration_s": duration}


def compare(backend: Any, requests: Sequence[BenchRequest], kind: str, temperature: float,
            rounds: int) -> dict[str, Any]:
    """``rounds`` pairs of timed passes, plain and constrained, alternating which goes first."""
    constrained = constrain(requests, kind)
    plain = constrain(requests, "none")
    compile_grammar(backend, constrained, temperature)
    backend.run(plain, temperature)  # untimed: the first full batch pays one-time costs (allocations, kernels)
    passes: dict[str, list[dict[str, float | None]]] = {"unconstrained": [], "constrained": []}
    for round_index in range(rounds):
        order = [("unconstrained", plain), ("constrained", constrained)]
        for label, workload in order if round_index % 2 == 0 else order[::-1]:
            passes[label].append(timed_pass(backend, workload, temperature))
    result: dict[str, Any] = {"benchmark": "structured_output_cost", "structured_output": kind, "rounds": rounds,
                              "passes": passes}
    for metric in ("ms_per_output_token", "cpu_ms_per_output_token", "mean_tpot_ms"):
        for label, runs in passes.items():
            values = [v for run in runs if (v := run[metric]) is not None]
            if values:
                result[f"{label}_{metric}"] = statistics.median(values)
                result[f"{label}_{metric}_range"] = f"{min(values):.3f} to {max(values):.3f}"
        plain_value, constrained_value = (result.get(f"{label}_{metric}") for label in passes)
        if plain_value and constrained_value:
            result[f"{metric}_overhead"] = constrained_value / plain_value - 1
    result["unconstrained_output_tokens"] = passes["unconstrained"][0]["output_tokens"]
    result["constrained_output_tokens"] = passes["constrained"][0]["output_tokens"]
    return result


COMPARE_ROWS: list[Row] = [
    ("Constraint", "structured_output", ""),
    ("Rounds (median of)", "rounds", "d"),
    ("ms / output token, unconstrained", "unconstrained_ms_per_output_token", ".3f"),
    ("  range", "unconstrained_ms_per_output_token_range", ""),
    ("ms / output token, constrained", "constrained_ms_per_output_token", ".3f"),
    ("  range", "constrained_ms_per_output_token_range", ""),
    ("Overhead per output token", "ms_per_output_token_overhead", "+.1%"),
    ("CPU ms / output token, unconstrained", "unconstrained_cpu_ms_per_output_token", ".3f"),
    ("  range", "unconstrained_cpu_ms_per_output_token_range", ""),
    ("CPU ms / output token, constrained", "constrained_cpu_ms_per_output_token", ".3f"),
    ("  range", "constrained_cpu_ms_per_output_token_range", ""),
    ("Overhead in CPU time per output token", "cpu_ms_per_output_token_overhead", "+.1%"),
    ("Mean TPOT (ms), unconstrained", "unconstrained_mean_tpot_ms", ".2f"),
    ("Mean TPOT (ms), constrained", "constrained_mean_tpot_ms", ".2f"),
    ("Overhead in TPOT", "mean_tpot_ms_overhead", "+.1%"),
    ("Output tokens, unconstrained", "unconstrained_output_tokens", "d"),
    ("Output tokens, constrained", "constrained_output_tokens", "d"),
]


def print_comparison(result: dict[str, Any]) -> None:
    print_tables(summary_table("Structured output cost", result, COMPARE_ROWS))
