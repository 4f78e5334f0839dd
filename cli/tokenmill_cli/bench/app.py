"""``tokenmill bench``: throughput, latency, serve, and random-model to make
something to benchmark. Each command only gathers its options; the work is
in the module of the same name."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tokenmill.config import EngineConfig
from tokenmill_cli.bench.options import (
    BackgroundKind,
    BackgroundLoad,
    BenchSeed,
    CustomOutputLen,
    DatasetName,
    DatasetPath,
    DisableTqdm,
    MetricPercentiles,
    NumPrefixes,
    NumPrompts,
    OfflineBackend,
    OutputJson,
    PrefixLen,
    PrefixOutputLen,
    RandomInputLen,
    RandomMMDistinctImages,
    RandomMMImageSize,
    RandomMMNumImages,
    RandomOutputLen,
    RandomPrefixLen,
    RandomRangeRatio,
    SharegptOutputLen,
    SuffixLen,
    Tokenizer,
)
from tokenmill_cli.engine_options import MODEL_OPTION, engine_command

T = TypeVar("T")


def build_bench_app(config_cls: type[EngineConfig] = EngineConfig) -> typer.Typer:
    """The ``bench`` commands; throughput and latency take the engine options of ``config_cls``."""
    bench_app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
    spelling = {"model": MODEL_OPTION, "seed": typer.Option(help="Seeds the dataset, the arrivals and the engine")}
    bench_app.command("throughput", help="Offline throughput over a dataset: tokens/s, TTFT/TPOT/ITL, roofline.")(
        engine_command(throughput, config_cls, **spelling))
    bench_app.command("latency", help="One batch of fixed size, repeated: per-iteration and per-token latency, GB/s.")(
        engine_command(latency, config_cls, **spelling))
    bench_app.command("serve", help="Load a running OpenAI-compatible server: Poisson arrivals or a concurrency cap.")(
        serve)
    bench_app.command("embed", help="Embedding throughput (sentences/s) of a pooling model against "
                                     "sentence-transformers-style transformers pooling.")(
        engine_command(embed, config_cls, **spelling))
    bench_app.command("random-model", help="Write a random-weight Llama checkpoint (and tokenizer) to benchmark, "
                                            "or (--draft-of) a layer-skip draft of one.")(
        random_model)
    return bench_app


def _guarded(work: Callable[[], T]) -> T:
    """Bad input and missing files end the command with a message, not a traceback."""
    from tokenmill import TokenmillError

    try:
        return work()
    except (TokenmillError, ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _finish(result: dict[str, Any], *json_paths: Path | None) -> None:
    from tokenmill_cli.bench.report import write_json

    if result.get("errors"):
        typer.secho(f"{result.get('failed', 0)} requests failed; first error: {result['errors'][0]}",
                    fg=typer.colors.RED, err=True)
    for path in json_paths:
        if path is not None:
            write_json(path, result)


def _model_and_kwargs(engine: EngineConfig) -> tuple[str | None, dict[str, Any]]:
    """The model apart (the backends take it so), and every other option that has a value: the
    result's ``engine_args`` records what the engine ran with, defaults included."""
    kwargs = {name: value for name, value in engine.model_dump().items() if value is not None}
    return kwargs.pop("model", None), kwargs


def _percentiles(text: str) -> tuple[float, ...]:
    from tokenmill_cli.bench.metrics import parse_percentiles

    try:
        return parse_percentiles(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--metric-percentiles") from exc


def _background_kind(kind: str) -> str:
    from tokenmill_cli.bench.background_load import check_kind

    try:
        return check_kind(kind)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--background-kind") from exc


def throughput(
    engine: EngineConfig,
    backend: OfflineBackend = "tokenmill",
    hf_batch_size: Annotated[int, typer.Option("--hf-batch-size", "--hf-max-batch-size",
                                               help="Static batch size of --backend hf (1: one at a time)")] = 1,
    peak_gflops: Annotated[float | None, typer.Option(
        help="Machine peak for the roofline (default: measured by a float32 matmul)")] = None,
    dataset_name: DatasetName = "random",
    dataset_path: DatasetPath = None,
    num_prompts: NumPrompts = 64,
    random_input_len: RandomInputLen = 128,
    random_output_len: RandomOutputLen = 128,
    random_range_ratio: RandomRangeRatio = 0.0,
    random_prefix_len: RandomPrefixLen = 0,
    prefix_len: PrefixLen = 256,
    suffix_len: SuffixLen = 32,
    num_prefixes: NumPrefixes = 1,
    prefix_output_len: PrefixOutputLen = 128,
    sharegpt_output_len: SharegptOutputLen = None,
    custom_output_len: CustomOutputLen = 128,
    random_mm_num_images: RandomMMNumImages = 1,
    random_mm_image_size: RandomMMImageSize = 64,
    random_mm_distinct_images: RandomMMDistinctImages = 0,
    metric_percentiles: MetricPercentiles = "90,99",
    output_json: OutputJson = None,
    disable_tqdm: DisableTqdm = False,
    structured_output: Annotated[str, typer.Option(
        help="Constrain every request: none, json-schema, regex, choice or grammar (fixed constraints, "
             "see tokenmill_cli.bench.structured)")] = "none",
    compare_structured: Annotated[int, typer.Option(
        min=0, help="Run the workload N times plain and N times constrained (--structured-output, default "
                    "json-schema), alternating, and report the cost per output token both ways")] = 0,
    disable_log_stats: Annotated[bool, typer.Option(
        "--disable-log-stats", help="Run the engine without the server's stat loggers (Prometheus, the log "
                                    "line), to measure what metrics cost")] = False,
    background_load: BackgroundLoad = 0,
    background_kind: BackgroundKind = "matmul",
    lora: Annotated[list[str] | None, typer.Option(
        help="A LoRA adapter folder (repeatable): the requests are spread over them round robin (needs "
             "--enable-lora; --max-loras slots)")] = None,
) -> None:
    from tokenmill_cli.bench.datasets import DatasetOptions
    from tokenmill_cli.bench.structured import constraint_of, print_comparison
    from tokenmill_cli.bench.throughput import ThroughputOptions, print_throughput, run_throughput

    dataset = DatasetOptions(
        name=dataset_name, num_prompts=num_prompts, seed=engine.seed, random_input_len=random_input_len,
        random_output_len=random_output_len, random_range_ratio=random_range_ratio,
        random_prefix_len=random_prefix_len, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, prefix_output_len=prefix_output_len, sharegpt_output_len=sharegpt_output_len,
        dataset_path=dataset_path, custom_output_len=custom_output_len, random_mm_num_images=random_mm_num_images,
        random_mm_image_size=random_mm_image_size, random_mm_distinct_images=random_mm_distinct_images)
    try:
        constraint_of(structured_output)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--structured-output") from exc
    opts = ThroughputOptions(backend=backend, hf_batch_size=hf_batch_size, peak_gflops=peak_gflops,
                             percentiles=_percentiles(metric_percentiles), disable_tqdm=disable_tqdm,
                             structured_output=structured_output, compare_structured_rounds=compare_structured,
                             disable_log_stats=disable_log_stats, background_load=background_load,
                             background_kind=_background_kind(background_kind), lora_paths=tuple(lora or ()))
    model, kwargs = _model_and_kwargs(engine)
    result = _guarded(lambda: run_throughput(model, kwargs, dataset, opts))
    (print_comparison if compare_structured else print_throughput)(result)
    _finish(result, output_json)


def latency(
    engine: EngineConfig,
    backend: OfflineBackend = "tokenmill",
    input_len: Annotated[int, typer.Option(help="Prompt tokens of each request")] = 32,
    output_len: Annotated[int, typer.Option(help="Tokens each request generates")] = 128,
    batch_size: Annotated[int, typer.Option(help="Requests in the batch")] = 8,
    num_iters_warmup: Annotated[int, typer.Option(help="Iterations run before measuring")] = 3,
    num_iters: Annotated[int, typer.Option(help="Iterations measured")] = 10,
    metric_percentiles: MetricPercentiles = "90,99",
    output_json: OutputJson = None,
    disable_tqdm: DisableTqdm = False,
    background_load: BackgroundLoad = 0,
    background_kind: BackgroundKind = "matmul",
) -> None:
    from tokenmill_cli.bench.latency import LatencyOptions, print_latency, run_latency

    opts = LatencyOptions(backend=backend, input_len=input_len, output_len=output_len, batch_size=batch_size,
                          num_iters_warmup=num_iters_warmup, num_iters=num_iters, seed=engine.seed,
                          percentiles=_percentiles(metric_percentiles), disable_tqdm=disable_tqdm,
                          background_load=background_load, background_kind=_background_kind(background_kind))
    model, kwargs = _model_and_kwargs(engine)
    result = _guarded(lambda: run_latency(model, kwargs, opts))
    print_latency(result)
    _finish(result, output_json)


def serve(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="The model name to request; also the tokenizer unless --tokenizer (default: the "
                              "server's first model)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Name to request, when it differs from --model")] = None,
    tokenizer: Tokenizer = None,
    backend: Annotated[str, typer.Option(help="openai, vllm or tokenmill: all speak /v1/completions")] = "openai",
    base_url: Annotated[str | None, typer.Option(help="Server URL (default: http://HOST:PORT)")] = None,
    host: Annotated[str, typer.Option(help="Server host")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Server port")] = 8000,
    endpoint: Annotated[str, typer.Option(help="Completions path")] = "/v1/completions",
    request_rate: Annotated[float, typer.Option(help="Requests per second; inf sends all at once")] = math.inf,
    burstiness: Annotated[float, typer.Option(help="Gamma shape of the arrival gaps; 1 is Poisson")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Most requests in flight")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate exactly the requested lengths")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy")] = 0.0,
    api_key: Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token for the server")] = None,
    dataset_name: DatasetName = "random",
    dataset_path: DatasetPath = None,
    num_prompts: NumPrompts = 64,
    random_input_len: RandomInputLen = 128,
    random_output_len: RandomOutputLen = 128,
    random_range_ratio: RandomRangeRatio = 0.0,
    random_prefix_len: RandomPrefixLen = 0,
    prefix_len: PrefixLen = 256,
    suffix_len: SuffixLen = 32,
    num_prefixes: NumPrefixes = 1,
    prefix_output_len: PrefixOutputLen = 128,
    sharegpt_output_len: SharegptOutputLen = None,
    custom_output_len: CustomOutputLen = 128,
    seed: BenchSeed = 0,
    metric_percentiles: MetricPercentiles = "90,99",
    percentile_metrics: Annotated[str, typer.Option(
        help="Latency metrics the table shows: ttft, tpot, itl, e2el (the JSON has all)",
        rich_help_panel="Output")] = "ttft,tpot,itl,e2el",
    output_json: OutputJson = None,
    save_result: Annotated[bool, typer.Option("--save-result", help="Also save to --result-dir/--result-filename")] = False,
    result_dir: Annotated[Path, typer.Option(help="Folder of --save-result")] = Path("."),
    result_filename: Annotated[str | None, typer.Option(help="File name of --save-result")] = None,
    disable_tqdm: DisableTqdm = False,
    lora: Annotated[list[str] | None, typer.Option(
        help="A LoRA adapter's served name (repeatable): the requests name them in `model`, round robin "
             "(the server lists them in /v1/models: --enable-lora --lora-modules)")] = None,
    background_load: BackgroundLoad = 0,
    background_kind: BackgroundKind = "matmul",
) -> None:
    from tokenmill_cli.bench.datasets import DatasetOptions
    from tokenmill_cli.bench.metrics import LATENCY_METRICS
    from tokenmill_cli.bench.serve_client import ServeOptions, print_serve, run_serve

    dataset = DatasetOptions(
        name=dataset_name, num_prompts=num_prompts, seed=seed, random_input_len=random_input_len,
        random_output_len=random_output_len, random_range_ratio=random_range_ratio,
        random_prefix_len=random_prefix_len, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, prefix_output_len=prefix_output_len, sharegpt_output_len=sharegpt_output_len,
        dataset_path=dataset_path, custom_output_len=custom_output_len)
    opts = ServeOptions(base_url=base_url or f"http://{host}:{port}", endpoint=endpoint,
                        model=served_model_name or model, request_rate=request_rate, burstiness=burstiness,
                        max_concurrency=max_concurrency, ignore_eos=ignore_eos, temperature=temperature,
                        api_key=api_key, seed=seed, lora_models=tuple(lora or ()))
    percentiles = _percentiles(metric_percentiles)
    shown = tuple(m.strip() for m in percentile_metrics.split(",") if m.strip())
    if unknown := set(shown) - set(LATENCY_METRICS):
        raise typer.BadParameter(f"unknown metrics {sorted(unknown)}; choose from {', '.join(LATENCY_METRICS)}",
                                 param_hint="--percentile-metrics")
    requests = _guarded(lambda: _serve_requests(tokenizer or model, dataset))
    kind = _background_kind(background_kind)
    result = _guarded(lambda: _contended(lambda: run_serve(requests, opts, dataset.name, percentiles, disable_tqdm),
                                         background_load, kind))
    result["backend"] = backend
    print_serve(result, shown)
    saved = None
    if save_result:  # vLLM's way to name the file
        default_name = f"{backend}-{result['request_rate']}qps-{Path(str(result['model'])).name}.json"
        saved = result_dir / (result_filename or default_name)
    _finish(result, output_json, saved)


def _contended(run: Callable[[], dict[str, Any]], count: int, kind: str) -> dict[str, Any]:
    """``bench serve --background-load N``: the workload on the quiet machine, then again beside N busy
    processes (on this machine: for a server on the same one), the second run's figures reported with
    the first's (``quiet_<figure>``, ``relative_<figure>``). The same prompts twice: serve with
    ``--no-enable-prefix-caching`` so the second run does not find them cached."""
    from tokenmill_cli.bench.background_load import background_load
    from tokenmill_cli.bench.contention import contention_json, result_figures

    quiet = run() if count else None
    with background_load(count, kind):
        result = run()
    return {**result, **contention_json(count, kind, result_figures(result), quiet)}


def _serve_requests(tokenizer_source: str | None, dataset: Any) -> list[Any]:
    """The client side has no engine: the tokenizer comes from --tokenizer or --model."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from tokenmill_cli.bench.datasets import DatasetContext, Vocabulary, canonical_name, load_dataset

    if tokenizer_source is None:
        raise ValueError("bench serve needs --model or --tokenizer to build prompts")
    tok = AutoTokenizer.from_pretrained(tokenizer_source)
    dataset = replace(dataset, name=canonical_name(dataset.name))
    return load_dataset(dataset, DatasetContext(tok, Vocabulary.from_tokenizer(tok)))


def random_model(
    output: Annotated[Path, typer.Argument(help="Folder to write (created if missing)")],
    preset: Annotated[str | None, typer.Option(help="tiny (58M) or 100m; explicit sizes override it")] = None,
    hidden_size: Annotated[int | None, typer.Option()] = None,
    intermediate_size: Annotated[int | None, typer.Option()] = None,
    num_hidden_layers: Annotated[int | None, typer.Option()] = None,
    num_attention_heads: Annotated[int | None, typer.Option()] = None,
    num_key_value_heads: Annotated[int | None, typer.Option()] = None,
    vocab_size: Annotated[int | None, typer.Option(help="default: 32000")] = None,
    max_position_embeddings: Annotated[int | None, typer.Option(help="default: 2048")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights")] = 0,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    damp_layers_from: Annotated[int | None, typer.Option(
        min=0, help="Benchmark device for speculative decoding: the layers from this one on get their output "
                    "projections scaled by --damp-scale, so that a --draft-of draft of the first ones agrees with "
                    "the model most of the time")] = None,
    damp_scale: Annotated[float, typer.Option(min=0.0, help="With --damp-layers-from: the scale")] = 0.01,
    draft_of: Annotated[Path | None, typer.Option(
        help="Write a layer-skip draft of this checkpoint instead: its embedding, its first --num-hidden-layers "
             "layers, its final norm and lm_head (and its tokenizer)")] = None,
) -> None:
    from dataclasses import asdict

    from tokenmill_cli.bench.random_model import resolve_sizes, write_random_model

    if draft_of is not None:
        _write_draft(output, draft_of, num_hidden_layers)
        return
    sizes = _guarded(lambda: resolve_sizes(
        preset, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings))
    params = _guarded(lambda: write_random_model(output, sizes, seed, dtype, damp_layers_from, damp_scale))
    shape = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in asdict(sizes).items())
    typer.echo(f"wrote {output}: {params / 1e6:.1f}M parameters ({shape})")


def _write_draft(output: Path, target: Path, num_layers: int | None) -> None:
    from tokenmill_cli.bench.draft_pair import write_layer_skip_draft

    if num_layers is None:
        raise typer.BadParameter("a --draft-of draft needs --num-hidden-layers (how many of the target's layers)")
    params = _guarded(lambda: write_layer_skip_draft(target, output, num_layers))
    typer.echo(f"wrote {output}: the first {num_layers} layers of {target}, {params / 1e6:.1f}M parameters")


def embed(
    engine: EngineConfig,
    num_sentences: Annotated[int, typer.Option(min=1, help="Sentences per timed pass")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="The baseline's batch size (and tokenmill's max_num_seqs "
                                                        "at least)")] = 64,
    min_len: Annotated[int, typer.Option(min=3, help="Shortest sentence, in tokens")] = 32,
    max_len: Annotated[int, typer.Option(min=3, help="Longest sentence, in tokens")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Timed passes after the warm-up")] = 3,
    skip_hf: Annotated[bool, typer.Option(help="Time tokenmill alone")] = False,
    output_json: OutputJson = None,
) -> None:
    """Embedding throughput of tokenmill and of transformers with sentence-transformers pooling."""
    from tokenmill_cli.bench.embed import run_embed_bench

    result = _guarded(lambda: run_embed_bench(engine, num_sentences, batch_size, min_len, max_len, repeats,
                                              engine.seed, skip_hf))
    for key, value in result.items():
        typer.echo(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    _finish(result, output_json)
