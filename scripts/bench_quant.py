"""Quantized methods side by side: batch-1 decode, batch-64 throughput and peak RSS, one table.

From each float benchmark model (the issue-6 ``tiny`` and ``100m`` random Llamas, written
by ``tokenmill bench random-model`` if missing) this writes one checkpoint per method in
its real on-disk format, with the quantizers the tests use (tests/*_models.py; GGUF
through scripts/hf_to_gguf.py and the gguf package), then runs ``tokenmill bench
latency`` (batch 1) and ``tokenmill bench throughput`` (all prompts at once) on each, one
process per run so that each peak RSS is that run's alone. SmolLM2-135M (the default
model, Q4_1 GGUF) runs from its file, kept quantized and dequantised at load.

    bash scripts/bench-quant                                  # tiny and 100m, every method, then SmolLM2
    bash scripts/bench-quant --models tiny --methods float32,bfloat16,int8
    bash scripts/bench-quant --models tiny --output-len 16 --num-prompts 16    # a short smoke run

Prints a markdown table and writes RESULTS/quant.json (every run's own JSON beside it).
The methods, each with the activation dtype it runs in (``--quant-dtype`` overrides the
quantized ones'):

* ``float32``, ``bfloat16``: the float checkpoint;
* ``int8``: compressed-tensors W8A8 (int8 weights per channel, dynamic per-token int8
  activations; tests/w8a8_models.py), bfloat16 activations;
* ``gptq``: 4-bit, symmetric, group 128, v1 zeros (tests/gptq_models.py), bfloat16;
* ``awq``: 4-bit GEMM layout, group 128 (tests/awq_models.py), bfloat16;
* ``fp8``: float8_e4m3fn weights per channel, dynamic activations (tests/fp8_models.py), bfloat16;
* ``gguf-q8_0``, ``gguf-q4_0``: every 2-d tensor in the type (scripts/hf_to_gguf.py --type),
  float32 (the GGUF kernel computes in float32);
* SmolLM2 only: ``gguf-q4_1`` (its file, kept quantized) and ``float32`` / ``bfloat16``
  (``--quantization gguf-dequantized``).

The quantized formats keep the lm_head float (GPTQ, AWQ, W8A8, FP8 checkpoints leave it
out), but GGUF packs it too (as ``llama-quantize --pure``); the "weights per step" column
shows what each decode step reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RANDOM_MODELS = ("tiny", "100m")
SMOLLM2 = "smollm2"
QUANT_DTYPE = "bfloat16"  # the activations of the quantized rows (GGUF's kernel: float32)


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    dtype: str | None  # None: --quant-dtype
    write: Callable[[Path, Path], Path] | None = None  # (float folder, output folder) -> the model to load
    engine_args: tuple[str, ...] = ()


def _tests_path() -> None:
    """The tests' quantizers (tests/*_models.py) are plain modules of the tests folder."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))


def _with_twin(build: Callable[[Path, Path, Path], None]) -> Callable[[Path, Path], Path]:
    """The tests' writers also write the dequantised twin; it goes to a scratch folder and is dropped."""
    def write(float_folder: Path, out: Path) -> Path:
        _tests_path()
        with tempfile.TemporaryDirectory(prefix="bench-quant-twin-") as twin:
            build(float_folder, out, Path(twin))
        return out
    return write


def _w8a8(float_folder: Path, out: Path, twin: Path) -> None:
    from w8a8_models import build_w8a8_pair

    build_w8a8_pair(float_folder, out, twin)


def _gptq(float_folder: Path, out: Path, twin: Path) -> None:
    from gptq_models import GptqRecipe, build_gptq_pair

    build_gptq_pair(float_folder, out, twin, GptqRecipe(bits=4, group_size=128, sym=True))


def _awq(float_folder: Path, out: Path, twin: Path) -> None:
    from awq_models import build_awq_pair

    build_awq_pair(float_folder, out, twin, group_size=128)


def _fp8(float_folder: Path, out: Path, twin: Path) -> None:
    from fp8_models import build_fp8_pair

    build_fp8_pair(float_folder, out, twin, scheme="per-channel")


def _gguf(type_name: str) -> Callable[[Path, Path], Path]:
    def write(float_folder: Path, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{float_folder.name}-{type_name}.gguf"
        subprocess.run([sys.executable, str(REPO / "scripts" / "hf_to_gguf.py"), str(float_folder), str(path),
                        "--type", type_name], check=True)
        return path
    return write


RANDOM_MODEL_METHODS = {m.name: m for m in (
    Method("float32", "float32 weights", "float32"),
    Method("bfloat16", "bfloat16 weights", "bfloat16"),
    Method("int8", "W8A8 int8 (compressed-tensors)", None, _with_twin(_w8a8)),
    Method("gptq", "GPTQ int4, group 128", None, _with_twin(_gptq)),
    Method("awq", "AWQ int4, group 128", None, _with_twin(_awq)),
    Method("fp8", "FP8 e4m3 per channel", None, _with_twin(_fp8)),
    Method("gguf-q8_0", "GGUF Q8_0", "float32", _gguf("q8_0")),
    Method("gguf-q4_0", "GGUF Q4_0", "float32", _gguf("q4_0")),
)}
SMOLLM2_METHODS = {m.name: m for m in (
    Method("float32", "Q4_1 dequantised at load, float32", "float32",
           engine_args=("--quantization", "gguf-dequantized")),
    Method("bfloat16", "Q4_1 dequantised at load, bfloat16", "bfloat16",
           engine_args=("--quantization", "gguf-dequantized")),
    Method("gguf-q4_1", "GGUF Q4_1 kept (its file)", "float32"),
)}
ALL_METHODS = tuple(dict.fromkeys([*RANDOM_MODEL_METHODS, *SMOLLM2_METHODS]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,100m,smollm2", help="comma separated: tiny, 100m, smollm2")
    parser.add_argument("--methods", default=",".join(ALL_METHODS),
                        help=f"comma separated, of {', '.join(ALL_METHODS)} (a model runs those it has)")
    parser.add_argument("--quant-dtype", default=QUANT_DTYPE,
                        help="activation dtype of the quantized rows (GGUF's default: float32)")
    parser.add_argument("--model-dir", type=Path, default=REPO / "bench-models", help="float models, and quant/ below")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "quant", help="where JSON goes")
    parser.add_argument("--input-len", type=int, default=32, help="batch-1 latency: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="batch-1 latency: generated tokens")
    parser.add_argument("--num-iters", type=int, default=3, help="batch-1 latency: timed iterations (1 warm-up)")
    parser.add_argument("--num-prompts", type=int, default=64, help="throughput: prompts, all at once")
    parser.add_argument("--throughput-input-len", type=int, default=128)
    parser.add_argument("--throughput-output-len", type=int, default=128)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds before one run is given up")
    return parser.parse_args(argv)


def model_methods(model: str) -> dict[str, Method]:
    return SMOLLM2_METHODS if model == SMOLLM2 else RANDOM_MODEL_METHODS


def float_model(model_dir: Path, model: str) -> Path:
    folder = model_dir / model
    if not (folder / "config.json").exists():
        done = _tokenmill("bench", "random-model", str(folder), "--preset", model)
        if done.returncode != 0:
            raise SystemExit(f"tokenmill bench random-model {folder} failed:\n{done.stderr}")
    return folder


def checkpoint(args: argparse.Namespace, model: str, method: Method) -> str | None:
    """What ``--model`` gets: the float folder, a quantized one (written once, then reused) or
    None (SmolLM2: the default model)."""
    if model == SMOLLM2:
        return None
    folder = float_model(args.model_dir, model)
    if method.write is None:
        return str(folder)
    out = args.model_dir / "quant" / f"{model}-{method.name}"
    done = out / ".bench-quant-complete"
    if not done.exists():
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        written = method.write(folder, out)
        done.write_text(str(written))
        print(f"wrote {written} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return done.read_text()


def disk_mib(path: str | None) -> float | None:
    if path is None:
        from tokenmill_quant_gguf.default_model import smollm2_gguf_path

        path = str(smollm2_gguf_path())
    target = Path(path)
    files = [target] if target.is_file() else [f for f in target.iterdir() if f.suffix in (".safetensors", ".gguf")]
    return sum(f.stat().st_size for f in files) / 2**20


def _tokenmill(*argv: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill_cli", *argv], capture_output=True, text=True,
                          timeout=timeout, check=False)


def run_bench(kind: str, argv: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """One ``tokenmill bench`` run in its own process: its JSON, or the error it ended with."""
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        done = _tokenmill("bench", kind, *argv, "--disable-tqdm", "--output-json", str(out), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def bench_row(args: argparse.Namespace, model: str, method: Method) -> dict[str, Any]:
    dtype = method.dtype or args.quant_dtype
    path = checkpoint(args, model, method)
    engine = [*(("--model", path) if path is not None else ()), "--dtype", dtype, *method.engine_args,
              "--max-model-len", str(max(args.input_len + args.output_len,
                                         args.throughput_input_len + args.throughput_output_len))]
    stem = args.results / f"{model}-{method.name}"
    row: dict[str, Any] = {"model": model, "method": method.name, "description": method.description, "dtype": dtype,
                           "checkpoint": path, "checkpoint_mib": disk_mib(path)}
    if not args.skip_latency:
        row["latency"] = run_bench("latency", [*engine, "--batch-size", "1", "--input-len", str(args.input_len),
                                               "--output-len", str(args.output_len), "--num-iters-warmup", "1",
                                               "--num-iters", str(args.num_iters)],
                                   stem.with_name(stem.name + "-latency-b1.json"), args.run_timeout)
    if not args.skip_throughput:
        row["throughput"] = run_bench(
            "throughput", [*engine, "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
                           "--max-num-seqs", str(args.num_prompts),
                           "--random-input-len", str(args.throughput_input_len),
                           "--random-output-len", str(args.throughput_output_len)],
            stem.with_name(stem.name + f"-throughput-{args.num_prompts}.json"), args.run_timeout)
    return row


def decode_tok_s(row: dict[str, Any]) -> float | None:
    tpot = row.get("latency", {}).get("median_tpot_ms")
    return 1000.0 / tpot if tpot else None


def throughput_tok_s(row: dict[str, Any], key: str = "output_throughput") -> float | None:
    value = row.get("throughput", {}).get(key)
    return float(value) if value is not None else None


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _ratio(value: float | None, base: float | None) -> str:
    return "—" if value is None or not base else f"{value / base:.2f}x"


def markdown(rows: list[dict[str, Any]], num_prompts: int) -> str:
    header = ("| model | method | dtype | on disk (MiB) | weights a step reads (MiB) | batch-1 decode tok/s (TPOT ms) "
              f"| vs float32 | batch-{num_prompts} output tok/s (total) | vs bfloat16 | peak RSS batch 1 / "
              f"{num_prompts} (MiB) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        same = [r for r in rows if r["model"] == row["model"]]
        f32 = next((decode_tok_s(r) for r in same if r["method"] == "float32"), None)
        bf16 = next((throughput_tok_s(r) for r in same if r["method"] == "bfloat16"), None)
        latency, throughput = row.get("latency", {}), row.get("throughput", {})
        decode = decode_tok_s(row)
        errors = "; ".join(f"{kind}: {run['error']}" for kind in ("latency", "throughput")
                           if "error" in (run := row.get(kind, {})))
        step = latency.get("weight_bytes_per_step")
        cells = [row["model"], row["method"], row["dtype"], _fmt(row["checkpoint_mib"], ".1f"),
                 _fmt(step / 2**20 if step else None, ".1f"),
                 f"{_fmt(decode, '.1f')} ({_fmt(latency.get('median_tpot_ms'), '.2f')})", _ratio(decode, f32),
                 f"{_fmt(throughput_tok_s(row), '.0f')} ({_fmt(throughput_tok_s(row, 'total_token_throughput'), '.0f')})",
                 _ratio(throughput_tok_s(row), bf16),
                 f"{_fmt(latency.get('peak_rss_mib'), '.0f')} / {_fmt(throughput.get('peak_rss_mib'), '.0f')}"]
        lines.append("| " + " | ".join(cells) + " |" + (f" {errors}" if errors else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for model in models:
        if model not in (*RANDOM_MODELS, SMOLLM2):
            raise SystemExit(f"unknown model {model!r}: choose from {', '.join((*RANDOM_MODELS, SMOLLM2))}")
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {', '.join(unknown)}: choose from {', '.join(ALL_METHODS)}")
    started = time.perf_counter()
    rows = []
    for model in models:
        for name in methods:
            method = model_methods(model).get(name)
            if method is None:
                continue
            print(f"[{time.perf_counter() - started:6.0f} s] {model} {name}", file=sys.stderr, flush=True)
            rows.append(bench_row(args, model, method))
    table = markdown(rows, args.num_prompts)
    print(table)
    summary = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "threads": os.environ.get("TOKENMILL_NUM_THREADS"), "wall_s": time.perf_counter() - started,
               "rows": rows, "markdown": table}
    (args.results / "quant.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{len(rows)} rows in {summary['wall_s']:.0f} s; JSON: {args.results / 'quant.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
