"""How close a run came to the machine's limits.

Compute: a dense model does about 2 FLOPs per weight per token it
processes (a multiply and an add). The lm_head only runs where a token is
sampled, and embeddings are lookups, not matmuls, so:

    FLOPs = 2 * body_weights * processed_tokens + 2 * lm_head_weights * sampled_tokens

where a request processes its prompt (less what the prefix cache supplied)
and every generated token but the last, and samples each generated token.
Attention's own FLOPs (quadratic in context) are left out: at these lengths
they are small next to the weights', and leaving them out makes the figure a
lower bound. This counts useful work, so a backend that pads or generates
past a request's end gets no credit for it.

Memory: a decode step reads every weight once (whatever the batch), so
achieved bandwidth = weight bytes read per step / time per step (TPOT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill_cli.bench.metrics import RequestRecord


@dataclass(frozen=True)
class WeightCounts:
    body: int  # weights in matmuls every processed token goes through
    lm_head: int
    embedding: int
    step_bytes: int  # bytes a decode step reads: body and lm_head (embedding rows are negligible)

    @property
    def total(self) -> int:
        return self.body + self.lm_head + self.embedding


def count_weights(model: Any) -> WeightCounts:
    """Split a torch model's parameters into body, lm_head and embeddings.

    Tied embeddings (one tensor for both) count once, as the lm_head: that is
    the matmul it takes part in.
    """
    from torch import nn

    head = _lm_head_weight(model)
    # A quantized embedding (GGUF) has no float `weight`: its blocks are a `qweight` buffer.
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules()
                      if isinstance(m, nn.Embedding) and isinstance(getattr(m, "weight", None), nn.Parameter)}
    body = lm_head = embedding = step_bytes = 0
    seen: set[int] = set()
    for param in model.parameters():
        ptr = param.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        numel, size = param.numel(), param.numel() * param.element_size()
        if head is not None and ptr == head.data_ptr():
            lm_head += numel
            step_bytes += size
        elif ptr in embedding_ptrs:
            embedding += numel
        else:
            body += numel
            step_bytes += size
    # Weights kept in quantized blocks (GGUF's `qweight` buffers; a tied head reads the
    # embedding's) are read by every decode step too; only their bytes are known, not counts.
    step_bytes += sum(buffer.numel() * buffer.element_size() for name, buffer in model.named_buffers()
                      if name.endswith("qweight"))
    return WeightCounts(body, lm_head, embedding, step_bytes)


def _lm_head_weight(model: Any) -> Any:
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    return getattr(head, "weight", None)


def useful_flops(weights: WeightCounts, records: Sequence[RequestRecord], prefix_hit_tokens: int = 0) -> float:
    done = [r for r in records if r.ok]
    processed = sum(r.prompt_len + max(r.output_len - 1, 0) for r in done) - prefix_hit_tokens
    sampled = sum(r.output_len for r in done)
    return 2.0 * weights.body * processed + 2.0 * weights.lm_head * sampled


def roofline_json(flops: float, duration_s: float, peak_gflops: float, peak_source: str) -> dict[str, Any]:
    achieved = flops / duration_s / 1e9 if duration_s > 0 else 0.0
    return {
        "flops": flops,
        "achieved_gflops": achieved,
        "peak_gflops": peak_gflops,
        "peak_source": peak_source,
        "fraction": achieved / peak_gflops if peak_gflops > 0 else 0.0,
    }


def achieved_gbps(weights: WeightCounts, tpot_s: float) -> float:
    return weights.step_bytes / tpot_s / 1e9 if tpot_s > 0 else 0.0
