"""Request lifecycle in the engine and ``AsyncLLM``: aborts, timeouts, admission, and faults
that must fail one request (NaN logits, a detokenizer error, a broken stat logger) or,
when the engine itself fails, every request at once.

Faults come from real components: the fault-injection model plugin
(tests/plugins/tokenmill-fault-injection) and a tokenizer whose decoder raises.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
from fault_model import NAN_TOKEN, RAISE_TOKEN
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import AsyncLLM, EngineConfig, EngineDeadError, InvalidStateTransition, QueueFullError, SamplingParams
from tokenmill.engine.deadlines import Deadlines
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.admission import AdmissionLimits, AdmissionQueue
from tokenmill.errors import InvalidRequestError
from tokenmill.metrics.prometheus import PrometheusStatLogger

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory": "16MiB", "dtype": "float32"}
LONG = SamplingParams(max_tokens=240, ignore_eos=True, temperature=0)


def _assert_engine_clean(engine: LLMEngine) -> None:
    stats = engine.core.make_stats()
    assert not engine.core.has_unfinished_requests() and stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert engine.num_unfinished_requests == 0
    assert engine.num_deadlines == 0


async def _final(llm: AsyncLLM, prompt, params: SamplingParams, **kwargs):
    final = None
    async for output in llm.generate(prompt, params, **kwargs):
        final = output
    return final


async def _wait_until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def llm(llama_path):
    engine = AsyncLLM(str(llama_path), max_num_seqs=1, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


# -- pure parts ------------------------------------------------------------------------
def test_deadlines_expire_in_order_skip_ended_requests_and_stay_small():
    deadlines = Deadlines()
    deadlines.add("a", now=0.0, timeout_s=2.0)
    deadlines.add("b", now=0.0, timeout_s=1.0)
    deadlines.add("c", now=0.0, timeout_s=3.0)
    deadlines.discard("c")
    assert [e.request_id for e in deadlines.pop_expired(2.5)] == ["b", "a"]
    assert deadlines.pop_expired(10.0) == [] and len(deadlines) == 0
    deadlines.add("a", now=0.0, timeout_s=1.0)  # a reused id is a new request
    deadlines.discard("a")
    deadlines.add("a", now=0.0, timeout_s=5.0)
    assert deadlines.pop_expired(2.0) == []
    for i in range(1000):  # requests that end early leave no trail
        deadlines.add(f"r{i}", now=0.0, timeout_s=100.0)
        deadlines.discard(f"r{i}")
    assert len(deadlines._heap) <= 64


def test_admission_queue_bounds_requests_and_tokens():
    queue = AdmissionQueue(AdmissionLimits(max_queued_requests=2, max_queued_tokens=100))
    queue.admit("big", 500)  # alone: admitted, never refused forever
    with pytest.raises(QueueFullError) as exc:
        queue.admit("more", 10)
    assert exc.value.limit == "max_queued_tokens"
    queue.release("big")
    queue.release("big")  # idempotent
    queue.admit("a", 10)
    queue.admit("b", 10)
    with pytest.raises(QueueFullError) as exc:
        queue.admit("c", 10)
    assert exc.value.limit == "max_queued_requests"
    assert (queue.num_requests, queue.num_tokens) == (2, 20)


def test_non_finite_logit_bias_is_rejected():
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(logit_bias={5: float("nan")})
    assert exc.value.param == "logit_bias"


# -- aborts and timeouts -------------------------------------------------------------------
def test_abort_ends_the_request_frees_everything_and_a_second_abort_is_reported(llm):
    async def scenario():
        stream = llm.generate({"prompt_token_ids": [5, 6, 7]}, LONG, request_id="to-abort")
        first = await anext(stream)
        await llm.abort("to-abort", message="operator abort")
        rest = [output async for output in stream]
        with pytest.raises(InvalidStateTransition):
            await llm.abort("to-abort")  # already finished: the caller hears about it
        with pytest.raises(InvalidStateTransition):
            await llm.abort("never-existed")
        return first, rest[-1]

    first, final = asyncio.run(scenario())
    assert not first.finished
    assert final.finished and final.outputs[0].finish_reason == "abort" and final.error == "operator abort"
    assert 0 < len(final.outputs[0].token_ids) < 240
    _assert_engine_clean(llm.engine)


def test_a_caller_cancelled_while_its_request_is_being_added_never_breaks_the_loop(llm):
    """The add still happens and its abort follows: the request is accounted for, the loop goes on
    (a cancelled future used to be answered, which raised in the engine thread and killed it)."""
    async def scenario():
        task = asyncio.ensure_future(anext(llm.generate({"prompt_token_ids": [5]}, LONG, request_id="cancelled")))
        await asyncio.sleep(0)  # it has queued its add and waits for the engine thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: llm.engine.output_processor.num_unfinished == 0)
        return await _final(llm, {"prompt_token_ids": [6]}, SamplingParams(max_tokens=2))

    assert asyncio.run(scenario()).finished
    assert llm.is_running
    _assert_engine_clean(llm.engine)


def test_a_request_id_in_use_is_refused_without_touching_the_first(llm):
    async def scenario():
        first = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=3), request_id="same")
        output = await anext(first)
        with pytest.raises(InvalidRequestError):
            await anext(llm.generate({"prompt_token_ids": [6]}, request_id="same"))
        return [output async for output in first][-1] if not output.finished else output

    assert asyncio.run(scenario()).outputs[0].finish_reason == "length"
    _assert_engine_clean(llm.engine)


def test_a_slow_consumer_skips_to_the_newest_output(llm):
    """Outputs are cumulative: one that did not read while the request ran gets the final one
    next, not a backlog of one output per step."""
    async def scenario():
        stream = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=40, ignore_eos=True))
        first = await anext(stream)
        await _wait_until(lambda: llm.engine.output_processor.num_unfinished == 0)
        return first, [output async for output in stream]

    first, rest = asyncio.run(scenario())
    # How far the request got before the first read depends on the machine's load; what may
    # not happen is a backlog: after the first read, at most the one final output.
    assert len(rest) <= 1
    final = (rest or [first])[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 40


def test_abort_all_ends_every_request(llm):
    async def scenario():
        streams = [llm.generate({"prompt_token_ids": [5 + i]}, LONG) for i in range(3)]
        tasks = [asyncio.ensure_future(_drain(s)) for s in streams]
        await _wait_until(lambda: llm.scheduler_stats().num_running)
        aborted = await llm.abort_all("shutting down")
        return aborted, await asyncio.gather(*tasks)

    aborted, finals = asyncio.run(scenario())
    assert aborted == 3
    assert all(f.outputs[0].finish_reason == "abort" and f.error == "shutting down" for f in finals)
    _assert_engine_clean(llm.engine)


async def _drain(stream):
    final = None
    async for output in stream:
        final = output
    return final


def test_per_request_timeout_ends_a_queued_request_with_finish_reason_timeout(llm):
    """One sequence slot: the timed request waits behind a 240-token blocker and times out first."""
    async def scenario():
        blocker = asyncio.ensure_future(_final(llm, {"prompt_token_ids": [5, 6]}, LONG))
        await _wait_until(lambda: llm.scheduler_stats().num_running)
        start = time.monotonic()
        timed = await _final(llm, {"prompt_token_ids": [7, 8]}, LONG, timeout=0.05)
        elapsed = time.monotonic() - start
        return timed, elapsed, await blocker

    timed, elapsed, blocker = asyncio.run(scenario())
    assert timed.outputs[0].finish_reason == "timeout" and "timed out after 0.05 s" in timed.error
    assert blocker.outputs[0].finish_reason == "length"
    assert elapsed < 5
    _assert_engine_clean(llm.engine)
    with pytest.raises(InvalidRequestError):
        llm.generate("hi", timeout=0)


def test_config_request_timeout_applies_to_every_request(llama_path):
    engine = LLMEngine(EngineConfig(model=str(llama_path), request_timeout=0.05, **ENGINE_ARGS))
    engine.add_request("slow", {"prompt_token_ids": [5, 6]}, LONG)
    engine.add_request("own-limit", {"prompt_token_ids": [5, 6]}, LONG, timeout=60)
    engine.step()
    time.sleep(0.1)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["slow"].outputs[0].finish_reason == "timeout"
    assert len(finals["slow"].outputs[0].token_ids) == 1  # what it made before the deadline is kept
    assert finals["own-limit"].outputs[0].finish_reason == "length"
    _assert_engine_clean(engine)


def test_admission_refuses_past_max_queued_requests(llama_path):
    async def scenario(llm: AsyncLLM):
        first = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
        started = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)  # admitted; its first output cannot be handled before we yield again
        assert llm.admission.num_requests == 1
        with pytest.raises(QueueFullError):
            await anext(llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=2)))
        await started
        await _drain(first)
        return await _final(llm, {"prompt_token_ids": [7]}, SamplingParams(max_tokens=2))  # room again

    llm = AsyncLLM(str(llama_path), max_queued_requests=1, **ENGINE_ARGS)
    try:
        assert asyncio.run(scenario(llm)).finished
        assert llm.admission.num_requests == 0
    finally:
        llm.shutdown()


# -- faults that must fail one request ----------------------------------------------------
def test_nan_logits_fail_only_their_request(fault_model_path):
    llm = AsyncLLM(str(fault_model_path), **ENGINE_ARGS)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def scenario():
        prompts = [[5, 6, 7], [8, 9, NAN_TOKEN], [10, 11], [12]]
        return await asyncio.gather(*[_final(llm, {"prompt_token_ids": p}, params) for p in prompts])

    try:
        finals = asyncio.run(scenario())
        bad = finals[1]
        assert bad.outputs[0].finish_reason == "error" and "non-finite logits" in bad.error
        assert bad.outputs[0].token_ids == []
        for good in finals[:1] + finals[2:]:
            assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 12
            assert good.error is None
        _assert_engine_clean(llm.engine)
        assert llm.is_running
    finally:
        llm.shutdown()


class _RaisingDecoder:
    """A custom tokenizers decoder that fails on one token piece, as a broken tokenizer would."""

    def __init__(self, inner, poison: str) -> None:
        self.inner, self.poison = inner, poison

    def decode_chain(self, tokens: list[str]) -> list[str]:
        if self.poison in tokens:
            raise ValueError(f"cannot decode {self.poison!r}")
        return [self.inner.decode(tokens)]


def test_a_detokenizer_error_fails_only_its_request(llama_path):
    from tokenizers import decoders

    engine = LLMEngine(EngineConfig(model=str(llama_path), **ENGINE_ARGS))
    backend = engine.tokenizer.backend_tokenizer
    poison_id = engine.tokenizer.convert_tokens_to_ids("qu")
    backend.decoder = decoders.Decoder.custom(_RaisingDecoder(backend.decoder, "qu"))
    engine.add_request("victim", {"prompt_token_ids": [5, 6]},
                       SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={poison_id: 100}))
    for i in range(3):
        engine.add_request(f"ok{i}", {"prompt_token_ids": [7 + i]},
                           SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={poison_id: -100}))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert "output processing failed" in finals["victim"].error and "cannot decode" in finals["victim"].error
    for i in range(3):
        assert finals[f"ok{i}"].outputs[0].finish_reason == "length" and finals[f"ok{i}"].error is None
    _assert_engine_clean(engine)


def test_a_request_the_sampler_cannot_take_fails_alone(llama_path):
    """A batched draw that raises is retried row by row: only the request at fault fails."""
    engine = LLMEngine(EngineConfig(model=str(llama_path), **ENGINE_ARGS))
    bad = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={5: 1.0})
    bad.logit_bias["6"] = 1.0  # changed after validation: a key the sampler cannot compare with ids
    engine.add_request("bad", {"prompt_token_ids": [5, 6]}, bad)
    for i in range(2):
        engine.add_request(f"ok{i}", {"prompt_token_ids": [7 + i]}, SamplingParams(max_tokens=4, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["bad"].outputs[0].finish_reason == "error" and "sampling failed" in finals["bad"].error
    assert all(finals[f"ok{i}"].outputs[0].finish_reason == "length" for i in range(2))
    _assert_engine_clean(engine)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={"6": 1.0})


class _BrokenStatLogger:
    def record(self, scheduler, iteration) -> None:
        raise RuntimeError("metrics backend down")


def test_a_failing_stat_logger_never_stops_the_engine(llama_path, caplog):
    engine = LLMEngine(EngineConfig(model=str(llama_path), **ENGINE_ARGS), stat_loggers=[_BrokenStatLogger()])
    engine.add_request("r", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=4, ignore_eos=True))
    with caplog.at_level(logging.ERROR):
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert sum("stat logger" in r.getMessage() for r in caplog.records) == 1  # reported once, not per step


# -- the engine itself fails ---------------------------------------------------------------
def test_an_engine_failure_fails_every_stream_at_once(fault_model_path):
    llm = AsyncLLM(str(fault_model_path), **ENGINE_ARGS)

    async def consume(prompt):
        try:
            async for _ in llm.generate({"prompt_token_ids": prompt}, LONG):
                pass
        except EngineDeadError as exc:
            return exc
        return None

    async def scenario():
        healthy = [asyncio.ensure_future(consume([5 + i])) for i in range(3)]
        await _wait_until(lambda: llm.scheduler_stats().num_running == 3)
        start = time.monotonic()
        poisoned = await consume([9, RAISE_TOKEN])
        errors = await asyncio.gather(*healthy)
        return poisoned, errors, time.monotonic() - start

    try:
        poisoned, errors, elapsed = asyncio.run(scenario())
        assert isinstance(poisoned, EngineDeadError) and "poison token" in str(poisoned)
        assert all(isinstance(e, EngineDeadError) for e in errors)
        assert elapsed < 5
        assert not llm.is_running and "InjectedFault" in llm.dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(anext(llm.generate("hello")))
    finally:
        llm.shutdown()


# -- many requests, every way of ending ------------------------------------------------------
def test_in_process_load_with_aborts_timeouts_and_early_exits_leaves_nothing_behind(llama_path):
    """200 concurrent requests; some are aborted through the API, some leave the loop early
    (a disconnect), some time out; afterwards every block is free and the counters add up."""
    registry = CollectorRegistry()
    llm = AsyncLLM(str(llama_path), max_num_seqs=32, stat_loggers=[PrometheusStatLogger("tiny", registry)],
                   **ENGINE_ARGS)
    rng = random.Random(0)
    kinds = [rng.choice(["full", "full", "abort", "leave", "timeout"]) for _ in range(200)]

    async def one(i: int, kind: str):
        params = SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True)
        timeout = rng.uniform(0.01, 0.5) if kind == "timeout" else None
        stream = llm.generate({"prompt_token_ids": [3 + i % 300, 4]}, params, request_id=f"r{i}", timeout=timeout)
        final = None
        async for output in stream:
            final = output
            if kind == "leave" and len(output.outputs[0].token_ids) >= 2:
                await stream.aclose()
                return kind, None
            if kind == "abort" and len(output.outputs[0].token_ids) >= 1 and not output.finished:
                try:
                    await llm.abort(f"r{i}")
                except InvalidStateTransition:  # it finished meanwhile: reported, not swallowed
                    pass
        return kind, final

    async def scenario():
        return await asyncio.gather(*[one(i, k) for i, k in enumerate(kinds)])

    try:
        results = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
        for kind, final in results:
            if kind == "full":
                assert final.outputs[0].finish_reason == "length"
            elif kind in ("abort", "timeout"):
                assert final.finished and final.outputs[0].finish_reason in ("length", kind)
        deadline = time.monotonic() + 10
        while llm.engine.output_processor.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.02)  # the last early exits' aborts are still in the command queue
        _assert_engine_clean(llm.engine)
        assert llm.num_requests == 0 and llm.admission.num_requests == 0
        counts = {s.labels["finished_reason"]: s.value
                  for f in text_string_to_metric_families(generate_latest(registry).decode())
                  for s in f.samples if s.name == "tokenmill:request_success_total"}
        assert sum(counts.values()) == 200, counts
        assert counts["abort"] >= kinds.count("leave")
    finally:
        llm.shutdown()
