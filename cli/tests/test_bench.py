"""``tokenmill bench``: every command end to end on a tiny random model, the
datasets' shapes and the metrics' arithmetic.

Nothing here asserts a timing: timings belong in benchmarks, and this
machine is shared. What is checked is that the numbers add up.
"""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from tokenmill_cli.bench.datasets import (
    DatasetContext,
    DatasetOptions,
    Vocabulary,
    length_bounds,
    load_dataset,
    sharegpt_like_lengths,
)
from tokenmill_cli.bench.metrics import RequestRecord, compute_metrics, summarize
from tokenmill_cli.bench.random_model import PRESETS, LlamaSizes, resolve_sizes
from tokenmill_cli.bench.serve_client import arrival_offsets
from tokenmill_cli.bench.system import cpu_json
from tokenmill_cli.main import app

VOCAB = 512
SMALL = ["--hidden-size", "64", "--intermediate-size", "128", "--num-hidden-layers", "2",
         "--num-attention-heads", "4", "--num-key-value-heads", "2", "--vocab-size", str(VOCAB),
         "--max-position-embeddings", "256"]
ENGINE = ["--kv-cache-memory", "16MiB", "--disable-tqdm"]
STATS = ("mean", "median", "p90", "p99")

runner = CliRunner()


def invoke(args: list[str]) -> Any:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


def bench_json(tmp_path: Path, command: str, args: list[str]) -> dict[str, Any]:
    out = tmp_path / f"{command}.json"
    invoke(["bench", command, *args, "--output-json", str(out)])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bench-model")
    invoke(["bench", "random-model", str(folder), *SMALL])
    return folder


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ctx(tokenizer: Any) -> DatasetContext:
    return DatasetContext(tokenizer, Vocabulary.from_tokenizer(tokenizer, VOCAB))


RANDOM_RUN = ["--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "6",
              "--random-range-ratio", "0.5", "--seed", "3"]


@pytest.fixture(scope="module")
def throughput_result(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return bench_json(tmp_path_factory.mktemp("tp"), "throughput", ["--model", str(model_dir), *RANDOM_RUN, *ENGINE])


def assert_ordered(result: dict[str, Any], metric: str) -> None:
    values = [result[f"{stat}_{metric}_ms"] for stat in ("median", "p90", "p99")]
    assert all(v >= 0 for v in values) and values == sorted(values), (metric, values)
    assert all(f"{stat}_{metric}_ms" in result for stat in STATS)


# -- the checkpoint --------------------------------------------------------------------
def test_random_model_is_a_checkpoint_with_a_full_vocabulary(model_dir: Path, tokenizer: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, VOCAB)
    assert any(model_dir.glob("*.safetensors"))
    assert len(tokenizer) == VOCAB
    ids = list(range(4, VOCAB))  # every ordinary id is one character and survives a round trip
    text = tokenizer.decode(ids)
    assert len(text) == len(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_presets_and_explicit_sizes() -> None:
    assert PRESETS["tiny"] == LlamaSizes(512, 1536, 8, 8, 4, 32000)
    assert PRESETS["100m"] == LlamaSizes(768, 2048, 12, 12, 4, 32000)
    assert resolve_sizes("tiny", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="--intermediate-size"):
        resolve_sizes(None, hidden_size=64)


# -- datasets -------------------------------------------------------------------------
def test_random_dataset_lengths_stay_within_the_range_ratio(ctx: DatasetContext) -> None:
    opts = DatasetOptions(num_prompts=200, random_input_len=40, random_output_len=20, random_range_ratio=0.25, seed=1)
    requests = load_dataset(opts, ctx)
    (in_lo, in_hi), (out_lo, out_hi) = length_bounds(40, 0.25), length_bounds(20, 0.25)
    assert (in_lo, in_hi, out_lo, out_hi) == (30, 50, 15, 25)
    assert all(in_lo <= r.prompt_len <= in_hi and out_lo <= r.output_len <= out_hi for r in requests)
    assert len({r.prompt_len for r in requests}) > 5  # the ratio actually varies them
    special = set(ctx.tokenizer.all_special_ids)
    assert not any(t in special or t >= VOCAB for r in requests for t in r.prompt_token_ids)
    assert load_dataset(opts, ctx) == requests  # seeded
    fixed = load_dataset(DatasetOptions(num_prompts=5, random_input_len=7, random_output_len=3), ctx)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(7, 3)}


def test_prefix_dataset_shares_prefixes_and_not_suffixes(ctx: DatasetContext) -> None:
    opts = DatasetOptions(name="prefix_repetition", num_prompts=6, prefix_len=32, suffix_len=8, num_prefixes=2,
                          prefix_output_len=5)
    requests = load_dataset(opts, ctx)
    assert all(r.prompt_len == 40 and r.output_len == 5 for r in requests)
    prefixes = [tuple(r.prompt_token_ids[:32]) for r in requests]
    assert prefixes[0::2] == [prefixes[0]] * 3 and prefixes[1::2] == [prefixes[1]] * 3
    assert prefixes[0] != prefixes[1]
    assert len({tuple(r.prompt_token_ids[32:]) for r in requests}) == 6


def test_sharegpt_like_is_long_tailed_with_means_in_range(ctx: DatasetContext) -> None:
    lengths = np.array(sharegpt_like_lengths(np.random.default_rng(0), 5000))
    inputs, outputs = lengths[:, 0], lengths[:, 1]
    assert 200 <= inputs.mean() <= 300 and 200 <= outputs.mean() <= 300
    assert inputs.min() >= 4 and outputs.min() >= 4 and inputs.max() <= 1024 and lengths.sum(1).max() <= 2048
    for column in (inputs, outputs):  # long tail: mean above median, p99 far above it
        assert column.mean() > np.median(column) and np.percentile(column, 99) > 3 * np.median(column)
    requests = load_dataset(DatasetOptions(name="sharegpt-like", num_prompts=50, max_model_len=256), ctx)
    assert all(r.prompt_len + r.output_len <= 256 for r in requests)


def test_jsonl_dataset_reads_text_and_ids(ctx: DatasetContext, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 7}\n\n'
                    '{"prompt_token_ids": [10, 11, 12]}\n')
    requests = load_dataset(DatasetOptions(name="custom", dataset_path=path, num_prompts=3, custom_output_len=4), ctx)
    assert [r.output_len for r in requests] == [7, 4, 7]  # cycled to reach --num-prompts
    assert requests[0].prompt == "Hello there"
    assert requests[0].prompt_token_ids == ctx.tokenizer.encode("Hello there")
    assert requests[1].prompt_token_ids == [10, 11, 12] and requests[1].prompt is None
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(DatasetOptions(name="jsonl", dataset_path=path, num_prompts=1), ctx)


# -- metrics --------------------------------------------------------------------------
def test_metrics_follow_the_definitions() -> None:
    a = RequestRecord(prompt_len=10, sent=0.0)
    for n, at in enumerate([0.5, 0.6, 0.8, 0.9], 1):
        a.add_output(at, n)
    b = RequestRecord(prompt_len=4, sent=1.0)
    b.add_output(1.2, 3)  # one chunk carrying three tokens
    failed = RequestRecord(prompt_len=5, sent=0.0, error="boom")
    assert a.ttft == 0.5 and a.e2el == 0.9 and a.tpot == pytest.approx(0.4 / 3)
    assert a.itls == pytest.approx([0.1, 0.2, 0.1]) and b.itls == [] and b.tpot == 0.0
    metrics = compute_metrics([a, b, failed], duration_s=2.0)
    assert (metrics.completed, metrics.failed, metrics.total_input_tokens, metrics.total_output_tokens) == (2, 1, 14, 7)
    assert metrics.latencies_ms["ttft"]["mean"] == pytest.approx(350.0)
    assert metrics.output_throughput == pytest.approx(3.5)
    summary = summarize(np.random.default_rng(0).exponential(size=1000), (50, 90, 99))
    assert summary["p50"] == pytest.approx(summary["median"]) and summary["p50"] < summary["p90"] < summary["p99"]


def test_arrivals() -> None:
    rng = np.random.default_rng(0)
    assert arrival_offsets(4, math.inf, 1.0, rng) == [0.0] * 4
    offsets = arrival_offsets(4000, 10.0, 1.0, rng)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)
    assert np.diff(arrival_offsets(4000, 10.0, 8.0, rng)).std() < gaps.std()  # higher shape: more regular


# -- the commands ---------------------------------------------------------------------
def test_throughput_reports_consistent_numbers(throughput_result: dict[str, Any], model_dir: Path,
                                               ctx: DatasetContext) -> None:
    r = throughput_result
    expected = load_dataset(DatasetOptions(num_prompts=6, random_input_len=12, random_output_len=6,
                                           random_range_ratio=0.5, seed=3), ctx)
    assert (r["benchmark"], r["backend"], r["dataset_name"]) == ("throughput", "tokenmill", "random")
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    assert r["total_input_tokens"] == sum(q.prompt_len for q in expected)
    assert r["total_output_tokens"] == sum(q.output_len for q in expected)
    assert r["total_num_tokens"] == r["total_input_tokens"] + r["total_output_tokens"]
    for key in ("request_throughput", "input_throughput", "output_throughput", "total_token_throughput",
                "tokens_per_second", "duration", "peak_rss_mib", "startup_s", "achieved_gflops", "peak_gflops",
                "roofline_fraction", "useful_flops"):
        assert r[key] > 0, key
    assert r["peak_gflops_source"] == "measured"
    assert r["total_token_throughput"] == pytest.approx(r["input_throughput"] + r["output_throughput"])
    assert r["weights_lm_head"] == 64 * VOCAB
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert_ordered(r, metric)
    assert r["num_preemptions"] == 0 and r["peak_device_memory_mib"] is None
    assert r["prefix_cache_queries"] >= r["total_input_tokens"] and r["errors"] == []


def test_prefix_dataset_hits_the_prefix_cache(model_dir: Path, tmp_path: Path) -> None:
    # a small step budget makes the first prompt's prefix land in the cache before the others are scheduled
    r = bench_json(tmp_path, "throughput", [
        "--model", str(model_dir), "--dataset-name", "prefix", "--num-prompts", "4", "--prefix-len", "48",
        "--suffix-len", "4", "--prefix-repetition-output-len", "3", "--max-num-batched-tokens", "64",
        "--peak-gflops", "100", *ENGINE])
    assert r["completed"] == 4 and r["total_output_tokens"] == 12
    assert r["prefix_cache_hits"] > 0 and 0 < r["prefix_cache_hit_rate"] <= 1
    assert r["peak_gflops_source"] == "--peak-gflops"


def test_hf_backend_runs_the_same_workload(throughput_result: dict[str, Any], model_dir: Path,
                                           tmp_path: Path) -> None:
    r = bench_json(tmp_path, "throughput", ["--model", str(model_dir), *RANDOM_RUN, "--backend", "hf",
                                            "--hf-batch-size", "4", "--peak-gflops", "100", "--disable-tqdm"])
    assert (r["backend"], r["hf_batch_size"], r["completed"]) == ("hf", 4, 6)
    for key in ("total_input_tokens", "total_output_tokens", "weights_body", "weights_lm_head"):
        assert r[key] == throughput_result[key], key
    assert r["output_throughput"] > 0 and r["roofline_fraction"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert_ordered(r, metric)


def test_latency_reports_iterations_and_bandwidth(model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "latency", ["--model", str(model_dir), "--input-len", "8", "--output-len", "4",
                                         "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", *ENGINE])
    assert (r["benchmark"], r["batch_size"], r["num_iters"]) == ("latency", 2, 3)
    assert len(r["latencies"]) == 3 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert r["achieved_gbps"] > 0 and r["weight_bytes_per_step"] > 0 and r["output_throughput"] > 0
    assert r["read_ceiling_gbps"] > 0
    assert r["bandwidth_fraction"] == pytest.approx(r["achieved_gbps"] / r["read_ceiling_gbps"])
    for metric in ("latency", "ttft", "tpot"):
        assert_ordered(r, metric)


def test_latency_hf_backend(model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "latency", ["--model", str(model_dir), "--backend", "hf", "--input-len", "8",
                                         "--output-len", "3", "--batch-size", "2", "--num-iters-warmup", "0",
                                         "--num-iters", "2", "--disable-tqdm"])
    assert r["backend"] == "hf" and len(r["latencies"]) == 2 and r["achieved_gbps"] > 0


def test_bad_options_fail_cleanly(model_dir: Path) -> None:
    result = runner.invoke(app, ["bench", "throughput", "--model", str(model_dir), "--dataset-name", "nope",
                                 "--num-prompts", "1", *ENGINE])
    assert result.exit_code == 2 and "unknown dataset" in result.output
    result = runner.invoke(app, ["bench", "throughput", "--model", str(model_dir), "--random-input-len", "300",
                                 "--num-prompts", "1", *ENGINE])
    assert result.exit_code == 2 and "max_model_len" in result.output


# -- the contention benchmark --------------------------------------------------------------
def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, fields 14 and 15 of stat(5)


@pytest.mark.parametrize("kind", ["matmul", "python"])
def test_background_load_runs_busy_processes_and_always_stops_them(kind: str) -> None:
    from tokenmill_cli.bench.background_load import background_load

    with pytest.raises(KeyboardInterrupt), background_load(2, kind) as processes:
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
        deadline = time.monotonic() + 30
        while min(_cpu_ticks(p.pid) for p in processes) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(_cpu_ticks(p.pid) for p in processes) >= 5, "the busy processes did not run"
        raise KeyboardInterrupt  # an interrupted benchmark stops its neighbours too
    assert all(p.poll() is not None for p in processes)
    assert not any(Path(f"/proc/{p.pid}").exists() for p in processes)


def test_throughput_beside_a_busy_process_reports_the_quiet_run_too(model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "throughput", ["--model", str(model_dir), *RANDOM_RUN, *ENGINE,
                                            "--background-load", "1"])
    assert (r["background_load"], r["background_kind"]) == (1, "matmul")
    assert r["quiet_total_token_throughput"] > 0 and r["total_token_throughput"] > 0
    assert r["relative_total_token_throughput"] == pytest.approx(
        r["total_token_throughput"] / r["quiet_total_token_throughput"])
    assert r["completed"] == 6 and r["cpu_model"] == cpu_json()["cpu_model"]


def test_the_cpu_and_its_vector_extensions_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 fma avx512f "
                    "avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\n")
    assert cpu_json(str(info)) == {"cpu_model": "AMD EPYC 9R14", "cpu_isa": "avx2 fma avx512f avx512_vnni avx512_bf16"}
    assert cpu_json(str(tmp_path / "missing")) == {"cpu_model": None, "cpu_isa": None}


def test_latency_beside_a_busy_process_and_a_bad_kind(model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "latency", ["--model", str(model_dir), "--input-len", "8", "--output-len", "4",
                                         "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "2", *ENGINE,
                                         "--background-load", "1", "--background-kind", "python"])
    assert (r["background_load"], r["background_kind"]) == (1, "python") and len(r["latencies"]) == 2
    assert r["relative_avg_latency"] == pytest.approx(r["avg_latency"] / r["quiet_avg_latency"])
    result = runner.invoke(app, ["bench", "latency", "--model", str(model_dir), "--background-load", "1",
                                 "--background-kind", "bitcoin", *ENGINE])
    assert result.exit_code == 2 and "matmul" in result.output


def test_a_quiet_run_reports_no_load(throughput_result: dict[str, Any]) -> None:
    assert throughput_result["background_load"] is None and "quiet_total_token_throughput" not in throughput_result


# -- against a real server ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    import httpx

    if importlib.util.find_spec("tokenmill_cli.serve") is None:
        pytest.xfail("`tokenmill serve` is not built yet (cli/tokenmill_cli/serve.py)")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tokenmill_cli.main import main; main()", "serve", str(model_dir),
         "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tokenmill serve exited early:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tokenmill serve did not become healthy")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("arrivals", [["--request-rate", "50"], ["--max-concurrency", "2"]],
                         ids=["poisson", "max-concurrency"])
def test_serve_against_tokenmill_serve(server: str, model_dir: Path, ctx: DatasetContext, tmp_path: Path,
                                       arrivals: list[str]) -> None:
    r = bench_json(tmp_path, "serve", ["--base-url", server, "--model", str(model_dir), "--num-prompts", "5",
                                       "--random-input-len", "10", "--random-output-len", "6", "--ignore-eos",
                                       "--disable-tqdm", *arrivals])
    assert (r["benchmark"], r["completed"], r["failed"]) == ("serve", 5, 0), r["errors"]
    assert r["total_input_tokens"] == 50 and r["total_output_tokens"] == 30
    assert r["model"] == str(model_dir) and r["request_throughput"] > 0 and r["output_throughput"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert_ordered(r, metric)


def test_serve_beside_a_busy_process_reports_the_quiet_run_too(server: str, model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "serve", ["--base-url", server, "--model", str(model_dir), "--num-prompts", "3",
                                       "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
                                       "--disable-tqdm", "--background-load", "1", "--background-kind", "python"])
    assert (r["completed"], r["failed"], r["background_load"], r["background_kind"]) == (3, 0, 1, "python")
    assert r["relative_total_token_throughput"] == pytest.approx(
        r["total_token_throughput"] / r["quiet_total_token_throughput"])


def test_structured_output_cost_runs_both_ways(model_dir: Path, tmp_path: Path) -> None:
    r = bench_json(tmp_path, "throughput", ["--model", str(model_dir), *RANDOM_RUN, "--peak-gflops", "100",
                                            "--structured-output", "regex", *ENGINE])
    assert r["structured_output"] == "regex" and r["completed"] == 6 and r["ms_per_output_token"] > 0
    c = bench_json(tmp_path, "throughput", ["--model", str(model_dir), *RANDOM_RUN, "--compare-structured", "2",
                                            *ENGINE])
    assert (c["benchmark"], c["structured_output"], c["rounds"]) == ("structured_output_cost", "json-schema", 2)
    assert all(len(c["passes"][label]) == 2 for label in ("unconstrained", "constrained"))
    assert c["unconstrained_output_tokens"] == sum(q["output_tokens"] for q in c["passes"]["unconstrained"][:1])
    for label in ("unconstrained", "constrained"):
        assert c[f"{label}_ms_per_output_token"] > 0 and c[f"{label}_mean_tpot_ms"] >= 0
    assert "ms_per_output_token_overhead" in c
    result = runner.invoke(app, ["bench", "throughput", "--model", str(model_dir), "--structured-output", "xml",
                                 "--num-prompts", "1", *ENGINE])
    assert result.exit_code == 2 and "structured-output" in result.output


def test_throughput_and_latency_report_draft_acceptance(model_dir: Path, tmp_path: Path) -> None:
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    r = bench_json(tmp_path, "throughput", ["--model", str(model_dir), "--dataset-name", "prefix", "--num-prompts",
                                            "2", "--prefix-len", "32", "--suffix-len", "4",
                                            "--prefix-repetition-output-len", "24", *spec, *ENGINE])
    assert r["completed"] == 2 and r["total_output_tokens"] == 48
    assert r["spec_decode_num_draft_tokens"] >= r["spec_decode_num_accepted_tokens"] >= 0
    assert 0 <= r["spec_decode_acceptance_rate"] <= 1 and 1 <= r["spec_decode_mean_accepted_length"] <= 4
    r = bench_json(tmp_path, "latency", ["--model", str(model_dir), "--input-len", "8", "--output-len", "24",
                                         "--batch-size", "1", "--num-iters-warmup", "0", "--num-iters", "1",
                                         *spec, *ENGINE])
    assert 0 <= r["spec_decode_acceptance_rate"] <= 1


def test_latency_and_throughput_report_the_collectives_share_under_tensor_parallelism(
        model_dir: Path, tmp_path: Path, throughput_result: dict[str, Any]) -> None:
    assert "comm_ms_per_step" not in throughput_result  # one rank: no collectives to report
    tp = ["--tensor-parallel-size", "2", *ENGINE]
    r = bench_json(tmp_path, "latency", ["--model", str(model_dir), "--input-len", "8", "--output-len", "4",
                                         "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "2", *tp])
    t = bench_json(tmp_path, "throughput", ["--model", str(model_dir), "--num-prompts", "4", "--random-input-len",
                                            "8", "--random-output-len", "4", *tp])
    for result in (r, t):
        assert 0 < result["comm_ms_per_step"] < result["step_ms"]
        assert result["comm_step_fraction"] == pytest.approx(result["comm_ms_per_step"] / result["step_ms"])
        assert result["comm_calls_per_step"] >= 1 + 2 * 2  # the embedding's, and two per layer of SMALL's 2


def test_throughput_reports_the_pipeline_bubble_against_the_ideal(model_dir: Path, tmp_path: Path,
                                                                  throughput_result: dict[str, Any]) -> None:
    assert "pipeline_bubble_fraction" not in throughput_result  # one stage: no pipeline
    r = bench_json(tmp_path, "throughput", ["--model", str(model_dir), "--num-prompts", "6", "--random-input-len",
                                            "8", "--random-output-len", "6", "--pipeline-parallel-size", "2", *ENGINE])
    assert r["completed"] == 6 and len(r["pipeline_stage_idle_fractions"]) == 2
    assert all(0 <= idle < 1 for idle in r["pipeline_stage_idle_fractions"])
    assert r["pipeline_bubble_fraction"] == pytest.approx(sum(r["pipeline_stage_idle_fractions"]) / 2)
    m = r["pipeline_micro_batches_per_fill"]
    assert m > 1  # six requests over two stages: micro-batches overlapped
    assert r["pipeline_ideal_bubble_fraction"] == pytest.approx(1 / (m + 1))


def test_a_layer_skip_draft_of_a_damped_random_model(tmp_path: Path) -> None:
    """Layers damped to nothing write nothing into the residual stream: the draft of the layers
    before them computes exactly the target's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, draft = tmp_path / "target", tmp_path / "draft"
    invoke(["bench", "random-model", str(target), *SMALL, "--damp-layers-from", "1", "--damp-scale", "0"])
    invoke(["bench", "random-model", str(draft), "--draft-of", str(target), "--num-hidden-layers", "1"])
    big, small = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (target, draft))
    assert (big.config.num_hidden_layers, small.config.num_hidden_layers) == (2, 1)
    assert len(AutoTokenizer.from_pretrained(draft)) == VOCAB
    ids = torch.tensor([[5, 9, 33, 7, 100]])
    with torch.no_grad():
        assert torch.equal(big(ids).logits, small(ids).logits)
    result = runner.invoke(app, ["bench", "random-model", str(tmp_path / "x"), "--draft-of", str(target)])
    assert result.exit_code == 2 and "--num-hidden-layers" in result.output


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_a_benchmark_started_by_a_larger_process_reports_its_own_peak_memory():
    """scripts/bench_quant.py runs each benchmark in a process of its own, started after it wrote a
    checkpoint: the child's peak RSS is its own, not its parent's (which ru_maxrss carries over an exec)."""
    parent = (
        "import subprocess, sys\n"
        "ballast = bytearray(400 << 20)\n"  # the parent's 400 MiB, touched
        "for i in range(0, len(ballast), 4096): ballast[i] = 1\n"
        "print(subprocess.run([sys.executable, '-c', 'from tokenmill_cli.bench.system import peak_rss_bytes; "
        "print(peak_rss_bytes())'], capture_output=True, text=True, check=True).stdout)\n"
    )
    child_peak = int(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                                    check=True).stdout.split()[0])
    assert child_peak < 200 << 20
