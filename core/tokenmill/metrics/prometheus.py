"""Prometheus metrics, names prefixed ``tokenmill:``, labelled with the model name.

Counters that mirror engine totals (preemptions, prefix-cache tokens) are
advanced by the difference since the last step, so a counter never goes
backwards. Pass ``registry`` to keep several engines (tests) apart.
"""

from __future__ import annotations

from typing import Any, Literal

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenmill:{name}", doc, [*labels, *extra], registry=registry)

        def gauge(name: str, doc: str, multiprocess_mode: Literal["livesum", "livemax"]) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, labels, registry=registry, multiprocess_mode=multiprocess_mode)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=buckets, registry=registry)

        self.model = model_name
        # With PROMETHEUS_MULTIPROC_DIR each server process runs its own engine: request counts
        # add up over the live processes, and the fullest KV cache is the one to watch.
        self.running = gauge("num_requests_running", "Requests in the running batch", "livesum")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled", "livesum")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", "livemax")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.encoder_queries = counter("encoder_cache_queries", "Multimodal items looked up in the encoder cache")
        self.encoder_hits = counter("encoder_cache_hits", "Multimodal items found in the encoder cache")
        self.encoder_tokens = counter("encoder_input_tokens", "Encoder input tokens (image placeholder rows) "
                                      "scheduled to encode")
        self.encoder_deferrals = counter("encoder_budget_deferrals", "Prefill chunks cut short or held back "
                                         "because an image fit neither the step's encoder budget nor the encoder cache")
        self.external_hits = counter("prefix_cache_external_hits", "Prompt tokens loaded through the KV connector "
                                     "(a remote producer's KV, or an offload tier's)")
        self.waiting_for_kv = gauge("num_requests_waiting_for_remote_kvs", "Requests whose prompt KV is being "
                                    "loaded through the KV connector", "livesum")
        self.preemptions = counter("num_preemptions", "Requests preempted because the KV cache ran out")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.finished = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.aborted = counter("num_aborted_requests", "Requests aborted (client, timeout or shutdown)")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self.paused_requests = counter("spec_decode_num_paused_requests", "Requests switched off speculation for a "
                                       "while because their drafts were rarely accepted")
        self.paused_steps = counter("spec_decode_num_paused_steps", "Request steps without drafts because the "
                                    "request was switched off")
        self.drafting_off_steps = counter("spec_decode_num_steps_drafting_off", "Engine steps without drafts "
                                          "because more requests ran than disable_by_batch_size")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token", _LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token", _LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests", _TOKEN_BUCKETS)
        self.gen_len = histogram("request_generation_tokens", "Generated length of finished requests",
                                 _TOKEN_BUCKETS)
        self.step_tokens = histogram("iteration_tokens_total", "Tokens scheduled per engine step", _TOKEN_BUCKETS)
        self.waiting_for_lora = gauge("num_requests_waiting_for_lora", "Requests waiting for their LoRA adapter "
                                      "(loading, or every slot busy)", "livesum")
        self.lora_in_slots = gauge("lora_adapters_in_slots", "LoRA adapters in device slots", "livesum")
        self.lora_in_host = gauge("lora_adapters_in_host", "LoRA adapters in the host-memory cache", "livesum")
        # labelled by adapter only for those in a slot: at most max_loras series at a time
        self.lora_requests = Gauge("tokenmill:lora_requests", "Requests holding each resident LoRA adapter",
                                   [*labels, "lora_name"], registry=registry, multiprocess_mode="livesum")
        self.lora_load = histogram("lora_load_seconds", "Time to read and check a LoRA adapter", _LATENCY_BUCKETS)
        self._lora_names: set[str] = set()
        self._child: dict[Any, Any] = {}  # metric -> its child for this model
        for reason in FINISH_REASONS:  # every series present from the start, at zero
            self.finished.labels(self.model, reason)
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens, self.aborted,
                       self.draft_tokens, self.accepted_tokens, self.paused_requests, self.paused_steps,
                       self.drafting_off_steps, self.ttft, self.itl, self.e2e, self.queue,
                       self.prefill, self.decode, self.prompt_len, self.gen_len, self.step_tokens,
                       self.waiting_for_lora, self.lora_in_slots, self.lora_in_host, self.lora_load,
                       self.encoder_queries, self.encoder_hits, self.external_hits, self.waiting_for_kv,
                       self.encoder_tokens, self.encoder_deferrals):
            self._child[metric] = metric.labels(self.model)
        self._last = SchedulerSnapshot()

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        # Called after every step: the children are bound once (``labels()`` costs more than the
        # observation itself), which keeps metrics within the overhead budget of docs/benchmarks.md.
        child = self._child
        child[self.running].set(scheduler.num_running)
        child[self.waiting].set(scheduler.num_waiting)
        child[self.kv_usage].set(scheduler.kv_cache_usage)
        self._advance(self.prefix_queries, scheduler.prefix_cache_queries - self._last.prefix_cache_queries)
        self._advance(self.prefix_hits, scheduler.prefix_cache_hits - self._last.prefix_cache_hits)
        self._advance(self.preemptions, scheduler.num_preemptions - self._last.num_preemptions)
        self._advance(self.encoder_queries, scheduler.encoder_cache_queries - self._last.encoder_cache_queries)
        self._advance(self.encoder_hits, scheduler.encoder_cache_hits - self._last.encoder_cache_hits)
        self._advance(self.encoder_tokens, scheduler.encoder_input_tokens - self._last.encoder_input_tokens)
        self._advance(self.encoder_deferrals,
                      scheduler.encoder_budget_deferrals - self._last.encoder_budget_deferrals)
        self._advance(self.external_hits, scheduler.prefix_cache_external_hits - self._last.prefix_cache_external_hits)
        child[self.waiting_for_kv].set(scheduler.num_waiting_for_remote_kvs)
        self._advance(self.draft_tokens,
                      scheduler.spec_decode_num_draft_tokens - self._last.spec_decode_num_draft_tokens)
        self._advance(self.accepted_tokens,
                      scheduler.spec_decode_num_accepted_tokens - self._last.spec_decode_num_accepted_tokens)
        for metric, field in ((self.paused_requests, "spec_decode_num_paused_requests"),
                              (self.paused_steps, "spec_decode_num_paused_steps"),
                              (self.drafting_off_steps, "spec_decode_num_steps_drafting_off")):
            self._advance(metric, getattr(scheduler, field) - getattr(self._last, field))
        if scheduler.lora_adapters_in_host or self._lora_names:
            self._record_lora(scheduler)
        self._last = scheduler
        self._advance(self.prompt_tokens, iteration.num_prompt_tokens)
        self._advance(self.generation_tokens, iteration.num_generation_tokens)
        self._advance(self.aborted, iteration.num_aborted)
        if iteration.num_scheduled_tokens:
            child[self.step_tokens].observe(iteration.num_scheduled_tokens)
        ttft, itl = child[self.ttft], child[self.itl]
        for value in iteration.time_to_first_tokens:
            ttft.observe(value)
        for value in iteration.inter_token_latencies:
            itl.observe(value)
        for done in iteration.finished:
            self.finished.labels(self.model, done.finish_reason).inc()
            child[self.e2e].observe(done.e2e_latency)
            child[self.queue].observe(done.queue_time)
            child[self.prefill].observe(done.prefill_time)
            child[self.decode].observe(done.decode_time)
            child[self.prompt_len].observe(done.num_prompt_tokens)
            child[self.gen_len].observe(done.num_generation_tokens)

    def _record_lora(self, scheduler: SchedulerSnapshot) -> None:
        child = self._child
        child[self.waiting_for_lora].set(scheduler.num_waiting_for_lora)
        child[self.lora_in_slots].set(scheduler.lora_adapters_in_slots)
        child[self.lora_in_host].set(scheduler.lora_adapters_in_host)
        for seconds in scheduler.lora_load_seconds[len(self._last.lora_load_seconds):]:
            child[self.lora_load].observe(seconds)
        resident = dict(scheduler.lora_requests)
        for gone in self._lora_names - set(resident):
            self.lora_requests.remove(self.model, gone)
        for name, count in resident.items():
            self.lora_requests.labels(self.model, name).set(count)
        self._lora_names = set(resident)

    def _advance(self, counter: Counter, amount: int) -> None:
        if amount > 0:
            self._child[counter].inc(amount)
