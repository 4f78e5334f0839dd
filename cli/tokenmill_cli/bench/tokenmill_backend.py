"""tokenmill's own engine as a benchmark backend.

``run`` is ``LLM.generate``'s loop (add every request, step until none is
left) with a clock read after each step, so the throughput it measures is
the offline engine's and each request's outputs carry timestamps for TTFT,
TPOT and ITL. Reading the clock once per step costs nothing measurable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from tokenmill_cli.bench.backends import EngineCounters
from tokenmill_cli.bench.datasets import BenchRequest
from tokenmill_cli.bench.metrics import RequestRecord
from tokenmill_cli.bench.roofline import WeightCounts, count_weights


class TokenmillBackend:
    name = "tokenmill"

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], batch_size: int | None = None) -> None:
        """``batch_size`` is the baseline's knob; continuous batching takes ``max_num_seqs`` instead."""
        import torch

        from tokenmill import LLM

        self.llm = LLM(model, **engine_kwargs)
        info = self.llm.engine.model_info
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size: int = info.vocab_size
        self.max_model_len: int | None = info.max_model_len
        self.device = torch.device(info.device_type)
        self.dtype = getattr(torch, info.dtype)
        self.weights: WeightCounts | None = self.llm.engine.core.executor.collective_rpc(_count_weights)[0]

    def run(self, requests: Sequence[BenchRequest], temperature: float,
            on_finish: Callable[[], None] | None = None) -> list[RequestRecord]:
        from tokenmill import SamplingParams

        engine = self.llm.engine
        start = time.perf_counter()
        records: dict[str, RequestRecord] = {}
        try:
            for request in requests:
                request_id = engine.next_request_id()
                # detokenize=False: the records count tokens, and text per step would cost the
                # engine's step time that the caller does not need
                params = SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True,
                                        max_tokens=request.output_len, detokenize=False,
                                        # SamplingParams also takes the JSON (dict) form
                                        structured_outputs=cast(Any, request.structured_outputs))
                prepared = engine.prepare_request(request_id, self._prompt(request),
                                                  params, lora_request=self._lora(request.lora_path))
                engine.add_prepared(prepared)
                records[request_id] = RequestRecord(len(prepared.prompt.token_ids), start)  # image tokens too
        except Exception:
            for request_id in records:
                engine.abort_request(request_id)
            raise
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                record = records[output.request_id]
                num_tokens = len(output.outputs[0].token_ids)
                if num_tokens > record.output_len:
                    record.add_output(now, num_tokens)
                if output.finished:
                    record.error = output.error
                    if on_finish is not None:
                        on_finish()
        return list(records.values())

    def _prompt(self, request: BenchRequest) -> dict[str, Any]:
        """Token ids; or, for a request with images, its text after one placeholder per image."""
        if not request.images:
            return {"prompt_token_ids": request.prompt_token_ids}
        multimodal = self.llm.engine.input_processor.multimodal
        if multimodal is None:
            raise ValueError("the random-mm dataset needs a multimodal model (one that takes images)")
        text = multimodal.image_placeholder * len(request.images) + (request.prompt or "")
        return {"prompt": text, "multi_modal_data": {"image": list(request.images)}}

    def _lora(self, path: str | None) -> Any:
        """The adapter at ``path``, registered once under its path as its name."""
        if path is None:
            return None
        from tokenmill import LoRARequest

        lora = LoRARequest(path, 0, path)
        self.llm.engine.add_lora(lora)
        return lora

    def counters(self) -> EngineCounters:
        stats = self.llm.engine.scheduler_stats
        core = self.llm.engine.core
        ranks = core.executor.collective_rpc("communication_stats")
        comm = ranks[0]  # rank 0's
        busy: tuple[float, ...] = ()
        micro_batches = fills = 0
        if core.micro_batches is not None:  # pipeline stages: each one's first rank (ranks are stage-major)
            busy = tuple(r["step_seconds"] - r["pipeline_blocked_seconds"]
                         for r in ranks[::core.config.tensor_parallel_size])
            micro_batches, fills = core.micro_batches.stats.sent, core.micro_batches.stats.fills
        return EngineCounters(stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions,
                              stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                              stats.spec_decode_num_accepted_tokens, comm["comm_seconds"], int(comm["comm_calls"]),
                              comm["step_seconds"], int(comm["steps"]), busy, micro_batches, fills,
                              spec_paused_requests=stats.spec_decode_num_paused_requests,
                              spec_paused_steps=stats.spec_decode_num_paused_steps,
                              spec_steps_drafting_off=stats.spec_decode_num_steps_drafting_off)


def _count_weights(worker: Any) -> WeightCounts:
    """On the worker (rank 0): its model's weights, split for the roofline."""
    return count_weights(worker.runner.model)
