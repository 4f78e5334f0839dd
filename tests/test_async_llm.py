"""AsyncLLM: streaming, abort, disconnect, errors."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tokenmill import LLM, AsyncLLM, InvalidRequestError, InvalidStateTransition, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_path):
    engine = AsyncLLM(str(llama_path), max_model_len=128, kv_cache_memory="16MiB")
    yield engine
    engine.shutdown()


def _all_blocks_free(engine: AsyncLLM) -> bool:
    stats = engine.scheduler_stats()
    return stats.kv_blocks_free == stats.kv_blocks_total


async def _collect(engine, prompt, params, request_id=None):
    outputs = [out async for out in engine.generate(prompt, params, request_id=request_id)]
    return outputs


def test_stream_is_cumulative_and_matches_offline(engine, llama_path):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    outputs = asyncio.run(_collect(engine, prompt, params))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(tokens))
    offline = LLM(str(llama_path), max_model_len=128, kv_cache_memory="16MiB").generate(prompt, params)
    assert tokens[-1] == offline[0].outputs[0].token_ids


def test_concurrent_requests_all_finish(engine):
    async def run():
        params = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
        return await asyncio.gather(*[_collect(engine, {"prompt_token_ids": [3 + i, 4, 5]}, params) for i in range(6)])

    results = asyncio.run(run())
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 8 for r in results)
    assert _all_blocks_free(engine)


def test_abort_ends_the_request_and_frees_blocks(engine):
    async def run():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        agen = engine.generate({"prompt_token_ids": [9] * 20}, params, request_id="to-abort")
        first = await agen.__anext__()
        await engine.abort("to-abort")
        rest = [out async for out in agen]
        with pytest.raises(InvalidStateTransition):
            await engine.abort("to-abort")
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert _all_blocks_free(engine)


def test_consumer_leaving_early_aborts(engine):
    async def run():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        agen = engine.generate({"prompt_token_ids": [11] * 20}, params, request_id="leaver")
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(run())
    assert _all_blocks_free(engine)


def test_bad_input_raises_at_once_and_engine_goes_on(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="empty"):
            await _collect(engine, "", SamplingParams())
        return await _collect(engine, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True))

    assert asyncio.run(run())[-1].finished


def test_the_engine_is_built_and_stepped_on_its_own_thread(llama_path, monkeypatch, caplog):
    """On the CPU, torch's OpenMP runtime keeps a worker team per thread that starts parallel
    work; a model loaded on one thread and stepped on another made two teams on two cores,
    and their workers slept between kernels (decode 1.5-1.8x slower)."""
    import threading

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.worker.model_runner import ModelRunner

    threads: dict[str, set[str]] = {"built": set(), "stepped": set()}
    build, step = LLMEngine.__init__, ModelRunner.execute_model

    def built_here(self, *args, **kwargs):
        threads["built"].add(threading.current_thread().name)
        build(self, *args, **kwargs)

    def stepped_here(self, *args, **kwargs):
        threads["stepped"].add(threading.current_thread().name)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", built_here)
    monkeypatch.setattr(ModelRunner, "execute_model", stepped_here)
    engine = AsyncLLM(str(llama_path), max_model_len=128, kv_cache_memory="16MiB")
    try:
        asyncio.run(_collect(engine, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3)))
    finally:
        engine.shutdown()
    assert threads == {"built": {"tokenmill-engine"}, "stepped": {"tokenmill-engine"}}
    assert "stepped on thread" not in caplog.text


def test_an_engine_that_cannot_be_built_raises_from_the_constructor(tmp_path):
    from tokenmill.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        AsyncLLM(str(tmp_path / "no-such-model"), max_model_len=128)


def test_stepping_an_offline_engine_from_another_thread_warns_once(llama_path, caplog):
    import threading

    llm = LLM(str(llama_path), max_model_len=128, kv_cache_memory="16MiB")
    params = SamplingParams(max_tokens=3)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert "stepped on thread" not in caplog.text
    for _ in range(2):
        worker = threading.Thread(target=llm.generate, args=({"prompt_token_ids": [5, 6, 7]}, params))
        worker.start()
        worker.join()
    assert caplog.text.count("stepped on thread") == 1
    assert "build the LLM on the thread that generates with it" in caplog.text
