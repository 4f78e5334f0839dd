"""Per-layer time of the Triton paged attention against the SDPA reference on a CUDA GPU,
and the decode kernel's share of the HBM bandwidth.

One "layer call" is what ``Attention.forward`` costs the backend: the KV write of the
step's new tokens and the attention itself; ``prepare`` (once per step, not per layer)
is timed apart. The bandwidth fraction counts only the keys and values each decode
token must read (``sum(seq_lens) * kv_heads * head_size * 2`` elements) against the
card's nominal peak (``--peak-gbps``, 4,800 GB/s for an H200).

    python attention/triton/benchmarks/bench_paged_attention.py [--output-json FILE]

Run by scripts/gpu-check; the cases come from tests/triton_attention_cases.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tokenmill_attn_triton.backend import TritonAttentionBackend
from triton_attention_cases import Case, build_inputs

from tokenmill_attn_sdpa.backend import SDPABackend

# Llama-3.2-1B's heads (32 query, 8 KV, head 64) and the bench's 100m preset (12 query, 4 KV, head 64)
SHAPES = {"1b": dict(num_heads=32, num_kv_heads=8, head_size=64),
          "100m": dict(num_heads=12, num_kv_heads=4, head_size=64)}


def cases() -> list[tuple[str, Case]]:
    out = []
    for shape, heads in SHAPES.items():
        for batch in (1, 64):
            for context in (1024, 4096):
                out.append((f"decode {shape} batch {batch} context {context}",
                            Case(tuple((context, 1) for _ in range(batch)), **heads)))
        out.append((f"prefill {shape} 4x1024", Case(tuple((0, 1024) for _ in range(4)), **heads)))
        out.append((f"mixed {shape} 2x512 prompts + 62 decodes at 2048",
                    Case(((0, 512), (0, 512), *((2048, 1) for _ in range(62))), **heads)))
    return out


def layer_ms(backend, inputs, iters: int) -> tuple[float, float]:
    """Median milliseconds of ``prepare`` and of one layer call."""
    metadata = inputs.metadata
    caches = (inputs.key_cache, inputs.value_cache)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return median(times)

    prepare = timed(lambda: backend.prepare(metadata))
    metadata.backend_data = backend.prepare(metadata)
    layer = timed(lambda: backend.forward(inputs.layer, inputs.query, inputs.key, inputs.value, caches, metadata))
    metadata.backend_data = None
    return prepare, layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, default=4800.0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"{'case':52} {'triton ms':>10} {'sdpa ms':>10} {'speedup':>8} {'KV GB/s':>9} {'of peak':>8}")
    for name, case in cases():
        inputs = build_inputs(case, device="cuda", dtype=dtype)
        triton_prepare, triton_layer = layer_ms(TritonAttentionBackend(), inputs, args.iters)
        sdpa_prepare, sdpa_layer = layer_ms(SDPABackend(), inputs, args.iters)
        row = {"case": name, "dtype": args.dtype, "triton_layer_ms": triton_layer, "sdpa_layer_ms": sdpa_layer,
               "triton_prepare_ms": triton_prepare, "sdpa_prepare_ms": sdpa_prepare}
        line = f"{name:52} {triton_layer:10.4f} {sdpa_layer:10.4f} {sdpa_layer / triton_layer:8.2f}"
        if name.startswith("decode"):
            kv_bytes = sum(c + q for c, q in case.requests) * case.num_kv_heads * case.head_size * 2
            gbps = kv_bytes * inputs.key_cache.element_size() / (triton_layer * 1e-3) / 1e9
            row |= {"kv_gbps": gbps, "peak_fraction": gbps / args.peak_gbps}
            line += f" {gbps:9.0f} {gbps / args.peak_gbps:8.1%}"
        print(line, flush=True)
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows},
                                                     indent=1))


if __name__ == "__main__":
    main()
