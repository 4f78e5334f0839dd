"""``tokenmill bench embed``: embedding throughput (sentences/s) of a pooling model, tokenmill
against sentence-transformers-style pooling with transformers, on the same sentences in one run.

The sentences are random words of the model's vocabulary, ``min_len``..``max_len`` tokens each
(special tokens included), seeded. The baseline is what sentence-transformers does: padded
batches of ``batch_size`` through ``transformers.AutoModel``, masked mean (or CLS / last) pooling,
normalised where the folder says; tokenmill gets the whole list at once (``LLM.embed``), its
scheduler batching by ``max_num_seqs`` and ``max_num_batched_tokens``. Both are timed after a
warm-up over the same sentences, tokenization included; the ratio comes from one process.

The timed passes alternate (tokenmill, transformers, tokenmill, ...), so that a machine whose
load changes during the run slows both sides alike, and each side's process CPU time is
reported beside its wall time: on a shared machine at one thread, CPU time is the work each
side did, whatever share of a core it was given.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import EngineConfig


def random_sentences(tokenizer: Any, count: int, min_len: int, max_len: int, seed: int) -> list[str]:
    """Texts whose encodings are ``min_len``..``max_len`` tokens long, [CLS] and [SEP] included."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    words.sort()
    sentences = []
    for _ in range(count):
        target = rng.randint(min_len, max_len)
        text = " ".join(rng.choice(words) for _ in range(target))
        ids = tokenizer(text, truncation=True, max_length=target)["input_ids"]
        sentences.append(tokenizer.decode(ids, skip_special_tokens=True))
    return sentences


def _hf_embed(model: Any, tokenizer: Any, sentences: list[str], batch_size: int, pooling: str,
              normalize: bool) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            batch = tokenizer(sentences[start : start + batch_size], padding=True, truncation=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            if pooling == "cls":
                pooled = hidden[:, 0]
            elif pooling == "mean":
                pooled = (hidden * mask).sum(1) / mask.sum(1)
            else:
                pooled = hidden[torch.arange(hidden.shape[0]), batch["attention_mask"].sum(1) - 1]
            out.append(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)
    return torch.cat(out).float()


@dataclass
class _Timing:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    result: Any = None


def _time_alternately(sides: list[Callable[[], Any]], repeats: int) -> list[_Timing]:
    """Mean wall and process CPU seconds of each side's pass, the sides' passes alternating
    after one warm-up pass each."""
    timings = [_Timing(result=work()) for work in sides]
    for _ in range(repeats):
        for work, timing in zip(sides, timings, strict=True):
            wall, cpu = time.perf_counter(), time.process_time()
            timing.result = work()
            timing.wall_s += (time.perf_counter() - wall) / repeats
            timing.cpu_s += (time.process_time() - cpu) / repeats
    return timings


def run_embed_bench(engine: EngineConfig, num_sentences: int, batch_size: int, min_len: int, max_len: int,
                    repeats: int, seed: int, skip_hf: bool = False) -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer

    from tokenmill import LLM
    from tokenmill_cli.bench.system import peak_rss_bytes

    config = engine.model_copy(update={"runner": "pooling" if engine.runner == "auto" else engine.runner,
                                       "max_num_seqs": max(engine.max_num_seqs, batch_size)})
    llm = LLM(**config.model_dump())
    info = llm.engine.model_info
    pooler = info.pooler
    assert pooler is not None
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    sentences = random_sentences(tokenizer, num_sentences, min_len, max_len, seed)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    sides: list[Callable[[], Any]] = [lambda: torch.tensor([o.embedding for o in llm.embed(sentences)])]
    if not skip_hf:
        model = AutoModel.from_pretrained(info.path, dtype=getattr(torch, info.dtype)).eval()
        sides.append(lambda: _hf_embed(model, tokenizer, sentences, batch_size, pooler.pooling, pooler.normalize))
    timings = _time_alternately(sides, repeats)
    ours = timings[0]
    result: dict[str, Any] = {
        "model": info.path, "num_sentences": num_sentences, "batch_size": batch_size,
        "tokens_min": min(lengths), "tokens_max": max(lengths), "tokens_mean": sum(lengths) / len(lengths),
        "threads": torch.get_num_threads(), "dtype": info.dtype,
        "tokenmill_sentences_per_s": num_sentences / ours.wall_s,
        "tokenmill_cpu_s_per_pass": ours.cpu_s,
    }
    if not skip_hf:
        theirs = timings[1]
        result["hf_sentences_per_s"] = num_sentences / theirs.wall_s
        result["hf_cpu_s_per_pass"] = theirs.cpu_s
        result["speedup"] = theirs.wall_s / ours.wall_s
        result["cpu_speedup"] = theirs.cpu_s / ours.cpu_s
        result["min_cosine"] = float(torch.nn.functional.cosine_similarity(ours.result, theirs.result, dim=-1).min())
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result
