"""Options the bench commands share, as ``Annotated`` aliases (the engine options of
throughput and latency are generated from ``EngineConfig`` by :mod:`tokenmill_cli.engine_options`).

Names follow ``vllm bench``, so a vLLM command line works with the program
name changed; where tokenmill has a shorter name too, both are accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

_DATA = "Dataset"
_OUT = "Output"

Tokenizer = Annotated[str | None, typer.Option(help="Tokenizer folder or hub id (default: the model's)")]

DatasetName = Annotated[str, typer.Option(
    help="random, sharegpt-like, prefix (alias prefix_repetition), jsonl (alias custom) or random-mm (images, "
         "for a multimodal model)", rich_help_panel=_DATA)]
DatasetPath = Annotated[Path | None, typer.Option(
    help="The prompts file of the jsonl dataset", rich_help_panel=_DATA, exists=True, dir_okay=False)]
NumPrompts = Annotated[int, typer.Option(help="Number of requests", rich_help_panel=_DATA)]
RandomInputLen = Annotated[int, typer.Option("--random-input-len", "--input-len",
                                             help="Prompt tokens (random dataset)", rich_help_panel=_DATA)]
RandomOutputLen = Annotated[int, typer.Option("--random-output-len", "--output-len",
                                              help="Tokens to generate (random dataset)", rich_help_panel=_DATA)]
RandomRangeRatio = Annotated[float, typer.Option(
    help="Lengths vary uniformly within len*(1-r) .. len*(1+r), 0 <= r < 1", rich_help_panel=_DATA)]
RandomPrefixLen = Annotated[int, typer.Option(help="Random tokens put before every random prompt, the same for all",
                                              rich_help_panel=_DATA)]
PrefixLen = Annotated[int, typer.Option("--prefix-repetition-prefix-len", "--prefix-len",
                                        help="Shared prefix tokens (prefix dataset)", rich_help_panel=_DATA)]
SuffixLen = Annotated[int, typer.Option("--prefix-repetition-suffix-len", "--suffix-len",
                                        help="Distinct suffix tokens (prefix dataset)", rich_help_panel=_DATA)]
NumPrefixes = Annotated[int, typer.Option("--prefix-repetition-num-prefixes", "--num-prefixes",
                                          help="Distinct prefixes, shared round robin (prefix dataset)",
                                          rich_help_panel=_DATA)]
PrefixOutputLen = Annotated[int, typer.Option("--prefix-repetition-output-len",
                                              help="Tokens to generate (prefix dataset)", rich_help_panel=_DATA)]
SharegptOutputLen = Annotated[int | None, typer.Option(
    help="Fix the output length instead of drawing it (sharegpt-like dataset)", rich_help_panel=_DATA)]
CustomOutputLen = Annotated[int, typer.Option(
    help="Tokens to generate where a jsonl line gives none (jsonl dataset)", rich_help_panel=_DATA)]
RandomMMNumImages = Annotated[int, typer.Option(min=0, help="Images per prompt (random-mm dataset)",
                                               rich_help_panel=_DATA)]
RandomMMImageSize = Annotated[int, typer.Option(min=1, help="Side of each square random image, in pixels "
                                                           "(random-mm dataset)", rich_help_panel=_DATA)]
RandomMMDistinctImages = Annotated[int, typer.Option(
    min=0, help="Draw the images from this many pictures (repeats hit the encoder cache); 0: all distinct "
                "(random-mm dataset)", rich_help_panel=_DATA)]
BenchSeed = Annotated[int, typer.Option(help="Seeds the dataset, the arrivals and the engine")]

OutputJson = Annotated[Path | None, typer.Option(help="Write the results to this JSON file", rich_help_panel=_OUT)]
DisableTqdm = Annotated[bool, typer.Option("--disable-tqdm", help="No progress bar", rich_help_panel=_OUT)]
MetricPercentiles = Annotated[str, typer.Option(
    help="Percentiles to report besides mean and median, comma separated", rich_help_panel=_OUT)]
OfflineBackend = Annotated[str, typer.Option(
    help="tokenmill (alias vllm) or hf: the same workload through transformers generate")]
BackgroundLoad = Annotated[int, typer.Option(
    min=0, help="Run the workload quiet, then beside N busy processes (one core's work each), and report both "
                "(see tokenmill_cli.bench.background_load)", rich_help_panel="Contention")]
BackgroundKind = Annotated[str, typer.Option(
    help="What the busy processes of --background-load run: matmul (numpy) or python (a pure-Python loop)",
    rich_help_panel="Contention")]
