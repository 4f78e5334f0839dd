"""The baseline: the same requests through transformers ``generate``.

Requests run in their dataset order in static batches of ``batch_size``
(1: one at a time), left-padded so every prompt ends where generation
starts. A batch runs until its longest request is done (that is what a
static batch costs); each request is credited only its own ``output_len``
tokens. A streamer timestamps each generation step, so TTFT, TPOT and ITL
mean what they mean for tokenmill.

The process is set up as tokenmill's platform would set it up (thread
count, default dtype, device), so the two backends differ only in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill_cli.bench.backends import EngineCounters
from tokenmill_cli.bench.datasets import BenchRequest
from tokenmill_cli.bench.metrics import RequestRecord
from tokenmill_cli.bench.roofline import WeightCounts, count_weights


class _StepClock:
    """A ``generate`` streamer that only notes when each step's tokens arrive.

    ``generate`` first hands it the prompt, then one tensor of new tokens per step.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFBackend:
    name = "hf"

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], batch_size: int | None = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tokenmill.config import EngineConfig
        from tokenmill.model_loader.resolve import resolve_model_path
        from tokenmill.platform import detect_platform, resolve_dtype
        from tokenmill.plugins.manager import get_plugin_manager

        if model is None:
            raise ValueError("--backend hf needs --model: a transformers checkpoint folder or hub id")
        batch_size = batch_size or 1
        if batch_size < 1:
            raise ValueError("--hf-batch-size must be at least 1")
        config = EngineConfig(model=model, **engine_kwargs)
        platform = detect_platform(get_plugin_manager())
        platform.configure_process(config)
        path = resolve_model_path(model, config.revision)
        self.device = platform.device()
        self.batch_size = batch_size
        self.dtype = resolve_dtype(config.dtype, platform)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to() narrowly
        self.model.generation_config.eos_token_id = None  # ignore EOS, as the tokenmill runs do
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or path)
        self.vocab_size: int = self.model.config.vocab_size
        self.max_model_len: int | None = config.max_model_len or getattr(self.model.config,
                                                                         "max_position_embeddings", None)
        self.weights: WeightCounts | None = count_weights(self.model)
        pad = self.tokenizer.pad_token_id
        self._pad_id: int = pad if pad is not None else 0
        self._torch = torch

    def run(self, requests: Sequence[BenchRequest], temperature: float,
            on_finish: Callable[[], None] | None = None) -> list[RequestRecord]:
        if any(r.lora_path for r in requests):
            raise ValueError("the hf backend has no LoRA adapters; measure them with --backend tokenmill")
        if any(r.structured_outputs for r in requests):
            raise ValueError("the hf backend has no structured outputs; measure them with --backend tokenmill")
        start = time.perf_counter()
        records: list[RequestRecord] = []
        for first in range(0, len(requests), self.batch_size):
            batch = requests[first:first + self.batch_size]
            records.extend(self._run_batch(batch, start, temperature))
            if on_finish is not None:
                for _ in batch:
                    on_finish()
        return records

    def _run_batch(self, batch: Sequence[BenchRequest], sent: float, temperature: float) -> list[RequestRecord]:
        torch = self._torch
        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):  # left padding: prompts end at the same column
            input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - request.prompt_len:] = 1
        longest = max(r.output_len for r in batch)
        clock = _StepClock()
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
                    if temperature > 0 else {"do_sample": False})
        with torch.inference_mode():
            self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                max_new_tokens=longest, min_new_tokens=longest, pad_token_id=self._pad_id,
                                streamer=clock, **sampling)
        records = []
        for request in batch:
            record = RequestRecord(request.prompt_len, sent)
            for count, at in enumerate(clock.times[:request.output_len], 1):
                record.add_output(at, count)
            records.append(record)
        return records

    def counters(self) -> EngineCounters:
        return EngineCounters()  # no prefix cache, no preemption in a static batch
