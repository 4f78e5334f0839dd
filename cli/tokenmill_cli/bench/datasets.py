"""Benchmark workloads: each dataset turns options into ``BenchRequest``s
(prompt token ids and the number of tokens to generate), reproducibly from
a seed.

Four datasets, named as ``vllm bench`` names them where it has them:

- ``random``: prompts of random token ids, lengths uniform in
  ``[len * (1 - r), len * (1 + r)]`` for ``--random-range-ratio r``.
- ``sharegpt-like``: ShareGPT's shape without the file (see
  :func:`sharegpt_like_lengths`).
- ``prefix`` (``prefix_repetition``): prompts that share a long common
  prefix, then distinct suffixes; what the prefix cache is for.
- ``jsonl`` (``custom``): the user's own prompts, one JSON object a line.
- ``random-mm`` (``random_mm``): random prompts, each with ``--random-mm-num-images``
  random-pixel images of ``--random-mm-image-size`` pixels square before the text, for a
  multimodal model; ``--random-mm-distinct-images N`` draws them from N pictures only
  (repeats: what the encoder cache is for).

Random prompts draw from the tokenizer's ordinary ids (no special tokens),
so no prompt accidentally holds an EOS or a chat-template marker.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None  # the text, for datasets that start from text (jsonl)
    structured_outputs: dict[str, Any] | None = None  # a constraint (StructuredOutputsParams' JSON form)
    lora_path: str | None = None  # the LoRA adapter it runs with (bench --lora)
    images: tuple[Any, ...] = ()  # PIL images put before the prompt's text (random-mm), one placeholder each

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class DatasetOptions:
    """Every dataset's knobs; each dataset reads only its own."""

    name: str = "random"
    num_prompts: int = 64
    seed: int = 0
    random_input_len: int = 128
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_len: int = 256
    suffix_len: int = 32
    num_prefixes: int = 1
    prefix_output_len: int = 128
    sharegpt_output_len: int | None = None
    dataset_path: Path | None = None
    custom_output_len: int = 128
    max_model_len: int | None = None  # a request longer than this is an error (resampled for sharegpt-like)
    random_mm_num_images: int = 1
    random_mm_image_size: int = 64
    random_mm_distinct_images: int = 0  # 0: every image its own


@dataclass(frozen=True)
class Vocabulary:
    """The token ids random prompts are drawn from."""

    ids: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, model_vocab_size: int | None = None) -> Vocabulary:
        """Ids both the tokenizer and the model know, minus special tokens."""
        size = len(tokenizer)
        if model_vocab_size is not None:
            size = min(size, model_vocab_size)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = np.array([i for i in range(size) if i not in special], dtype=np.int64)
        if ids.size == 0:
            raise ValueError("the tokenizer has no ordinary (non-special) token ids to draw prompts from")
        return cls(ids)

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        return self.ids[rng.integers(0, self.ids.size, size=count)].tolist()


@dataclass(frozen=True)
class DatasetContext:
    """What datasets need from the model: its tokenizer and vocabulary."""

    tokenizer: Any
    vocab: Vocabulary


# -- random -------------------------------------------------------------------------
def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    """The inclusive range ``--random-range-ratio`` allows around ``length`` (never below 1)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def random_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    rng = np.random.default_rng(opts.seed)
    in_lo, in_hi = length_bounds(opts.random_input_len, opts.random_range_ratio)
    out_lo, out_hi = length_bounds(opts.random_output_len, opts.random_range_ratio)
    prefix = ctx.vocab.sample(rng, opts.random_prefix_len)
    requests = []
    for _ in range(opts.num_prompts):
        input_len = int(rng.integers(in_lo, in_hi + 1))
        output_len = int(rng.integers(out_lo, out_hi + 1))
        requests.append(BenchRequest(prefix + ctx.vocab.sample(rng, input_len), output_len))
    return requests


# -- sharegpt-like ---------------------------------------------------------------------
# ShareGPT conversations (as vLLM's benchmarks filter them: 4 <= prompt <= 1024,
# 4 <= output, prompt + output <= 2048) have long-tailed, roughly log-normal
# lengths. These parameters give means of about 225 input and 255 output tokens
# (medians about 160 and 180) after the same filter (see docs/benchmarks.md).
SHAREGPT_INPUT = (math.log(165.0), 1.0)  # (mu, sigma) of the log-normal
SHAREGPT_OUTPUT = (math.log(180.0), 0.9)
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_INPUT = 1024
SHAREGPT_MAX_TOTAL = 2048


def sharegpt_like_lengths(rng: np.random.Generator, count: int,
                          max_total: int = SHAREGPT_MAX_TOTAL) -> list[tuple[int, int]]:
    """``count`` (input, output) length pairs, each drawn independently from a
    log-normal and redrawn until it passes ShareGPT's filter (and ``max_total``)."""
    pairs: list[tuple[int, int]] = []
    max_total = min(max_total, SHAREGPT_MAX_TOTAL)
    if max_total < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"sharegpt-like needs a context of at least {2 * SHAREGPT_MIN_LEN} tokens")
    while len(pairs) < count:
        need = count - len(pairs)
        inputs = np.rint(rng.lognormal(*SHAREGPT_INPUT, size=need)).astype(int)
        outputs = np.rint(rng.lognormal(*SHAREGPT_OUTPUT, size=need)).astype(int)
        keep = ((inputs >= SHAREGPT_MIN_LEN) & (inputs <= SHAREGPT_MAX_INPUT) & (outputs >= SHAREGPT_MIN_LEN)
                & (inputs + outputs <= max_total))
        pairs.extend(zip(inputs[keep].tolist(), outputs[keep].tolist(), strict=True))
    return pairs[:count]


def sharegpt_like_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    rng = np.random.default_rng(opts.seed)
    max_total = opts.max_model_len or SHAREGPT_MAX_TOTAL
    if opts.sharegpt_output_len is not None:  # a fixed output length leaves only the input to draw
        max_total -= opts.sharegpt_output_len - SHAREGPT_MIN_LEN
    lengths = sharegpt_like_lengths(rng, opts.num_prompts, max_total)
    return [BenchRequest(ctx.vocab.sample(rng, n_in), opts.sharegpt_output_len or n_out) for n_in, n_out in lengths]


# -- prefix -----------------------------------------------------------------------------
def prefix_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    """``num_prompts`` prompts over ``num_prefixes`` shared prefixes (round robin), each
    with its own random suffix, so every prompt after a prefix's first can reuse its KV."""
    if opts.num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    rng = np.random.default_rng(opts.seed)
    prefixes = [ctx.vocab.sample(rng, opts.prefix_len) for _ in range(opts.num_prefixes)]
    return [BenchRequest(prefixes[i % opts.num_prefixes] + ctx.vocab.sample(rng, opts.suffix_len),
                         opts.prefix_output_len)
            for i in range(opts.num_prompts)]


# -- jsonl --------------------------------------------------------------------------------
def jsonl_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    """One JSON object a line: ``prompt`` (text) or ``prompt_token_ids``, and optionally
    ``output_len`` (or ``max_tokens``; default ``--custom-output-len``). Too few lines
    are cycled to reach ``--num-prompts``, as vLLM oversamples."""
    if opts.dataset_path is None:
        raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
    rows = [_jsonl_request(json.loads(line), opts.custom_output_len, ctx.tokenizer, f"{opts.dataset_path}:{n}")
            for n, line in enumerate(opts.dataset_path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise ValueError(f"{opts.dataset_path} holds no prompts")
    if len(rows) < opts.num_prompts:
        print(f"note: {opts.dataset_path} has {len(rows)} prompts; repeating them to make {opts.num_prompts}",
              file=sys.stderr)
    return [rows[i % len(rows)] for i in range(opts.num_prompts)]


def _jsonl_request(row: dict[str, Any], default_output_len: int, tokenizer: Any, where: str) -> BenchRequest:
    output_len = int(row.get("output_len", row.get("max_tokens", default_output_len)))
    if "prompt_token_ids" in row:
        return BenchRequest([int(t) for t in row["prompt_token_ids"]], output_len)
    if not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: each line needs a 'prompt' string or 'prompt_token_ids'")
    ids = list(tokenizer.encode(row["prompt"], add_special_tokens=True))
    return BenchRequest(ids, output_len, prompt=row["prompt"])


# -- random-mm ------------------------------------------------------------------------------
def random_mm_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    """Random prompts (as ``random``, given as text) with random-pixel images before them."""
    from PIL import Image

    if opts.random_mm_num_images < 0 or opts.random_mm_image_size < 1 or opts.random_mm_distinct_images < 0:
        raise ValueError("--random-mm-num-images and --random-mm-distinct-images must be >= 0, "
                         "--random-mm-image-size >= 1")
    rng = np.random.default_rng(opts.seed)
    size = opts.random_mm_image_size
    total = opts.num_prompts * opts.random_mm_num_images
    distinct = min(opts.random_mm_distinct_images or total, total)
    pictures = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(distinct)]
    text_requests = random_dataset(opts, ctx)
    requests = []
    for i, request in enumerate(text_requests):
        first = i * opts.random_mm_num_images
        images = tuple(pictures[(first + j) % distinct] for j in range(opts.random_mm_num_images))
        text = ctx.tokenizer.decode(request.prompt_token_ids)
        requests.append(BenchRequest(request.prompt_token_ids, request.output_len, prompt=text, images=images))
    return requests


# -- registry -------------------------------------------------------------------------
DatasetBuilder = Callable[[DatasetOptions, DatasetContext], list[BenchRequest]]

DATASETS: dict[str, DatasetBuilder] = {
    "random": random_dataset,
    "sharegpt-like": sharegpt_like_dataset,
    "prefix": prefix_dataset,
    "jsonl": jsonl_dataset,
    "random-mm": random_mm_dataset,
}
# vLLM's names for the same workloads, so its command lines keep working
ALIASES = {"prefix_repetition": "prefix", "prefix-repetition": "prefix", "custom": "jsonl",
           "sharegpt_like": "sharegpt-like", "random_mm": "random-mm"}


def canonical_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return name


def load_dataset(opts: DatasetOptions, ctx: DatasetContext) -> list[BenchRequest]:
    """Build the requests and check that each fits the context."""
    if opts.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    requests = DATASETS[canonical_name(opts.name)](opts, ctx)
    if opts.max_model_len is not None:
        for r in requests:
            if r.prompt_len + r.output_len > opts.max_model_len:
                raise ValueError(f"a request of {r.prompt_len} prompt + {r.output_len} output tokens exceeds "
                                 f"max_model_len={opts.max_model_len}; shorten the lengths or raise --max-model-len")
    return requests
