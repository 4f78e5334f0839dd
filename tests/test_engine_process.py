"""AsyncLLM(engine_process=True): the engine steps in a spawned process; the interface is the in-thread one.

Each test drives a real engine process over its real ZeroMQ channel; they share one (shut down by
the last), but the one that kills its engine's process. A loop that raises is in
tests/server/test_server_engine_process.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
from pathlib import Path

import pytest
from lora_models import ADAPTERS, build_adapter
from server.fake_hub import FakeHub

from tokenmill import (
    AsyncLLM,
    EngineDeadError,
    InvalidRequestError,
    InvalidStateTransition,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.errors import ModelNotFoundError
from tokenmill.lora import LoRAAdapterError, LoRAAdapterNotFoundError
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory": "16MiB", "dtype": "float32", "enable_lora": True,
               "max_lora_rank": 8}
HANG_GUARD_S = 60  # a failure that would otherwise hang the test ends it here instead
HELD_REPO = "tiny-org/held-lora"  # the stand-in Hub sends its weights only once the test lets it


class RecordingStatLogger:
    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        self.iterations.append(iteration)


@pytest.fixture(scope="module")
def stat_logger() -> RecordingStatLogger:
    return RecordingStatLogger()


@pytest.fixture(scope="module")
def adapter(llama_path, tmp_path_factory) -> LoRARequest:
    return LoRARequest("attn-r4", 1, str(build_adapter(llama_path, tmp_path_factory.mktemp("lora"), **ADAPTERS["attn-r4"])))


@pytest.fixture(scope="module")
def held_hub(adapter):
    """A stand-in Hub serving the adapter's folder; its weights file waits for ``held_hub.gate``."""
    hub = FakeHub(HELD_REPO, Path(adapter.lora_path), slow_files=frozenset({"adapter_model.safetensors"}),
                  gate=threading.Event())
    with hub:
        try:
            yield hub
        finally:
            hub.gate.set()  # a download still held must end, or the server cannot close


@pytest.fixture(scope="module")
def engine(llama_path, stat_logger, held_hub, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # the engine process's environment, taken when it starts
        env.setenv("HF_ENDPOINT", held_hub.url)
        env.setenv("HF_HUB_OFFLINE", "0")
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        engine = AsyncLLM(str(llama_path), engine_process=True, stat_loggers=[stat_logger], **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _all_blocks_free(engine: AsyncLLM) -> bool:
    stats = engine.scheduler_stats()
    return stats.kv_blocks_free == stats.kv_blocks_total


async def _collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


async def _eventually(condition) -> bool:
    for _ in range(250):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_outputs_are_the_in_thread_modes(engine, llama_path, adapter):
    """Greedy, seeded sampling (n=2) and a LoRA adapter's greedy, text and tokens: the same as the
    engine stepped on a thread."""
    requests = [({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
                ("Hello there", SamplingParams(temperature=0, max_tokens=8)),
                ({"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=6,
                                                              ignore_eos=True))]

    async def finals(llm):
        assert await llm.add_lora(adapter) and [lora.lora_name for lora in llm.list_loras()] == ["attn-r4"]
        with_lora = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, requests[0][1], lora_request=adapter)
        results = await asyncio.gather(*[_collect(llm, p, s) for p, s in requests], _drain(with_lora, keep=True))
        await llm.remove_lora("attn-r4")
        assert llm.list_loras() == []
        return [[(c.token_ids, c.text, c.finish_reason) for c in r[-1].outputs] for r in results]

    in_thread = AsyncLLM(str(llama_path), **ENGINE_ARGS)
    try:
        expected = asyncio.run(finals(in_thread))
    finally:
        in_thread.shutdown()
    assert expected[-1] != expected[0]  # the adapter moved the output
    assert asyncio.run(finals(engine)) == expected
    assert _all_blocks_free(engine)


def test_requests_go_on_while_an_adapter_is_read(engine, held_hub):
    """The engine process reads an adapter off its step loop: while the Hub holds its weights,
    other requests run to the end; once sent, the adapter is registered."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        load = asyncio.ensure_future(engine.add_lora(LoRARequest("held", 5, HELD_REPO)))
        assert await _eventually(lambda: "adapter_model.safetensors" in held_hub.downloads)  # the read is held
        finished = [await asyncio.wait_for(_collect(engine, {"prompt_token_ids": [3, 4, 5 + i]}, params), HANG_GUARD_S)
                    for i in range(3)]
        still_loading = not load.done()
        held_hub.gate.set()
        return finished, still_loading, await asyncio.wait_for(load, HANG_GUARD_S)

    finished, still_loading, added = asyncio.run(run())
    assert all(outputs[-1].finished for outputs in finished) and still_loading and added
    assert [lora.lora_name for lora in engine.list_loras()] == ["held"]
    asyncio.run(engine.remove_lora("held"))


def test_a_bad_grammar_fails_in_the_caller_and_only_the_engine_compiles(engine):
    """Constraints are checked here at admission (InvalidRequestError, a 400 when served); the
    grammar compiler, with its token tables, is built only in the engine's process."""
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    good = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(InvalidRequestError, match="regex"):
        asyncio.run(_collect(engine, "Hi", bad))
    outputs = asyncio.run(_collect(engine, "Hi", good))
    assert outputs[-1].outputs[0].text in ("yes", "no")
    assert engine.engine.structured.backend._compiler is None  # parsed here, never compiled here


def test_the_stream_is_cumulative(engine):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = asyncio.run(_collect(engine, {"prompt_token_ids": [7, 8, 9]}, params))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(tokens)) and len(tokens[-1]) == 10


def test_an_abort_reaches_the_engine(engine):
    async def run():
        agen = engine.generate({"prompt_token_ids": [9] * 20}, SamplingParams(max_tokens=100, ignore_eos=True),
                               request_id="to-abort")
        first = await agen.__anext__()
        await engine.abort("to-abort", "stop it")
        rest = [out async for out in agen]
        with pytest.raises(InvalidStateTransition):  # the engine's own error, raised here
            await engine.abort("to-abort")
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished
    assert rest[-1].outputs[0].finish_reason == "abort" and rest[-1].error == "stop it"
    assert len(rest[-1].outputs[0].token_ids) < 100
    assert _all_blocks_free(engine) and engine.num_unfinished_requests == 0


def test_a_consumer_that_leaves_aborts_its_request(engine):
    async def run():
        agen = engine.generate({"prompt_token_ids": [11] * 20}, SamplingParams(max_tokens=100, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()
        return await _eventually(lambda: engine.num_unfinished_requests == 0 and _all_blocks_free(engine))

    assert asyncio.run(run())


def test_bad_input_fails_in_the_caller_and_the_engine_goes_on(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="empty"):
            await _collect(engine, "", SamplingParams())
        with pytest.raises(LoRAAdapterError, match="nowhere"):  # the engine process's errors, as they were
            await engine.add_lora(LoRARequest("adapter", 9, "/nowhere"))
        with pytest.raises(LoRAAdapterNotFoundError) as error:
            await engine.remove_lora("unknown")
        return error.value, await _collect(engine, {"prompt_token_ids": [1, 2, 3]},
                                           SamplingParams(max_tokens=2, ignore_eos=True))

    not_found, outputs = asyncio.run(run())
    assert str(not_found) == str(LoRAAdapterNotFoundError("unknown")) and not_found.param == "model"
    assert outputs[-1].finished and engine.is_running and engine.list_loras() == []


def test_stat_loggers_run_here_on_what_the_engine_records(engine, stat_logger):
    before = sum(i.num_generation_tokens for i in stat_logger.iterations)
    asyncio.run(_collect(engine, {"prompt_token_ids": [2, 3, 4]}, SamplingParams(max_tokens=5, ignore_eos=True)))

    async def recorded() -> bool:
        return await _eventually(lambda: sum(i.num_generation_tokens for i in stat_logger.iterations) == before + 5)

    assert asyncio.run(recorded())
    assert any(f.num_generation_tokens == 5 for i in stat_logger.iterations for f in i.finished)


def test_an_engine_that_cannot_be_built_raises_its_error_from_the_constructor(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):  # the engine process's, rebuilt here
        AsyncLLM(str(tmp_path / "no-such-model"), engine_process=True)


def test_a_killed_engine_process_fails_open_and_later_requests(llama_path):
    engine = AsyncLLM(str(llama_path), engine_process=True, **ENGINE_ARGS)

    async def run():
        agen = engine.generate({"prompt_token_ids": [4] * 10}, SamplingParams(max_tokens=10_000, ignore_eos=True))
        await agen.__anext__()
        engine.engine.process.kill()
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await asyncio.wait_for(_drain(agen), HANG_GUARD_S)
        with pytest.raises(EngineDeadError):
            await _collect(engine, "hi", SamplingParams(max_tokens=2))

    try:
        asyncio.run(run())
        assert not engine.is_running and "exited" in str(engine.dead_reason)
    finally:
        engine.shutdown()


def test_ctrl_c_leaves_the_engine_process_to_the_servers_shutdown(engine):
    """Ctrl-C reaches the whole process group; the server drains its requests, then stops the engine."""
    os.kill(engine.engine.process.pid, signal.SIGINT)
    outputs = asyncio.run(_collect(engine, {"prompt_token_ids": [6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert outputs[-1].finished and engine.is_running


def test_shutdown_stops_the_engine_process(engine):
    """Last of the module's engine (its fixture's shutdown after this one does nothing)."""
    process = engine.engine.process
    engine.shutdown()
    assert process.exitcode == 0 and not engine.is_running
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(_collect(engine, "hi", SamplingParams(max_tokens=2)))


async def _drain(agen, keep: bool = False) -> list:
    return [out async for out in agen if keep]
