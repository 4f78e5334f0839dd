"""Expert load over a benchmark run: tokens routed to each expert of each MoE layer, and
how uneven that was (max over mean tokens per expert: 1.0 is perfectly balanced, the
number of experts the worst case). Read from the engine before and after the run
(``tokenmill.metrics.expert_load``); nothing for a model without MoE layers or for the
transformers backend."""

from __future__ import annotations

from typing import Any

from tokenmill_cli.bench.report import Row

EXPERT_LOAD_ROWS: list[Row] = [
    ("MoE layers", "moe_num_layers", "d"),
    ("Expert load max/mean (worst layer)", "moe_load_imbalance_max", ".2f"),
    ("Expert load max/mean (mean of layers)", "moe_load_imbalance_mean", ".2f"),
]


def backend_expert_loads(backend: Any) -> dict[str, list[int]] | None:
    """The engine's expert counters now; None without a tokenmill engine or MoE layers."""
    llm = getattr(backend, "llm", None)
    if llm is None:
        return None
    from tokenmill.metrics.expert_load import engine_expert_loads

    return engine_expert_loads(llm.engine) or None


def expert_load_json(before: dict[str, list[int]] | None, after: dict[str, list[int]] | None) -> dict[str, Any]:
    """A result's expert-load keys for the run between two reads (empty without MoE layers)."""
    if before is None or after is None:
        return {}
    from tokenmill.layers import load_imbalance
    from tokenmill.metrics.expert_load import loads_since

    run = loads_since(after, before)
    ratios = {layer: load_imbalance(load) for layer, load in run.items()}
    return {
        "moe_num_layers": len(run),
        "moe_load_imbalance_max": max(ratios.values()),
        "moe_load_imbalance_mean": sum(ratios.values()) / len(ratios),
        "moe_expert_load": {layer: {"tokens_per_expert": load, "max_mean_ratio": ratios[layer]}
                            for layer, load in run.items()},
    }
