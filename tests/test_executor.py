"""The executor seam: an executor chosen by name, ``collective_rpc``, workers built from a
picklable spec, rank-0-only sampling and the model info the core hands the front end.

The executors under test come from an installed plugin (tests/plugins/tokenmill-example-executor):
``recording`` is the in-process executor keeping every call it forwards; ``in-process-ranks``
runs two ranks in this process, each built only from an unpickled spec."""

from __future__ import annotations

import json
import pickle
import random
import threading

import pytest
import torch

from tokenmill import LLM, EngineConfig, PluginError, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.executor import UniProcExecutor
from tokenmill.hookspecs import hookimpl
from tokenmill.plugins.manager import PluginInfo, PluginManager
from tokenmill.request import RequestStatus
from tokenmill.scheduler.output import ModelRunnerOutput
from tokenmill.worker.spec import WorkerSpec
from tokenmill.worker.worker import Worker

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "16MiB"}


def _prompts(count: int = 6) -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(5, 50))]} for _ in range(count)]


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm: LLM, count: int = 6) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(_prompts(count), _greedy())]


@pytest.fixture(scope="module")
def default_llm(llama_path) -> LLM:
    return LLM(str(llama_path), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def expected(default_llm) -> list[list[int]]:
    return _tokens(default_llm)


def test_the_default_executor_is_the_in_process_one(default_llm):
    assert default_llm.engine.config.distributed_executor_backend == "uni"
    assert type(default_llm.engine.core.executor) is UniProcExecutor


def test_an_executor_registered_by_a_plugin_runs_the_model(llama_path, expected):
    llm = LLM(str(llama_path), distributed_executor_backend="recording", **ENGINE_ARGS)
    executor = llm.engine.core.executor
    assert type(executor).__module__ == "tokenmill_example_executor.executors"
    assert _tokens(llm) == expected
    assert executor.calls[:3] == ["kv_bytes_per_block", "kv_cache_budget", "allocate_kv_cache"]
    steps = executor.calls[3:]
    assert len(steps) >= 2 * 12 and steps == ["execute_model", "sample_tokens"] * (len(steps) // 2)
    llm.engine.shutdown()
    assert executor.calls[-1] == "shutdown"


def test_an_unknown_executor_name_lists_the_registered_ones(llama_path):
    with pytest.raises(ValueError, match=r"unknown distributed_executor_backend 'nope'; registered executors: "
                                         r"in-process-ranks, mp, ray, recording, uni"):
        LLM(str(llama_path), distributed_executor_backend="nope", **ENGINE_ARGS)


def _rank_times(worker: Worker, factor: int, offset: int = 0) -> tuple[int, int]:
    return worker.spec.rank, worker.spec.rank * factor + offset


def _thread(worker: Worker) -> int:
    return threading.get_ident()


def _fail(worker: Worker) -> None:
    raise RuntimeError("failing on purpose")


def test_collective_rpc_round_trips_a_method_and_a_function(default_llm):
    executor = default_llm.engine.core.executor
    per_block = executor.kv_bytes_per_block()
    assert executor.collective_rpc("kv_bytes_per_block") == [per_block] and per_block > 0
    assert executor.collective_rpc("attention_backend_name") == [executor.worker.runner.backend.name]
    assert executor.collective_rpc(_rank_times, (3,), {"offset": 4}) == [(0, 4)]
    future = executor.collective_rpc("kv_bytes_per_block", non_block=True)
    assert future.result(timeout=0) == [per_block]
    assert executor.collective_rpc(_rank_times, (3,), {"offset": 1}, non_block=True).result(timeout=0) == [(0, 1)]


def test_a_non_blocking_call_runs_on_the_calling_thread_and_fails_through_its_future(default_llm):
    """In process, a non-blocking call runs in place: the forward stays on the thread that built
    the model (the CPU's OpenMP teams belong to it)."""
    executor = default_llm.engine.core.executor
    assert executor.collective_rpc(_thread, non_block=True).result(timeout=0) == [threading.get_ident()]
    future = executor.collective_rpc(_fail, non_block=True)
    assert isinstance(future.exception(timeout=0), RuntimeError)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        executor.collective_rpc(_fail)
    for private in ("_fail", "runner", "no_such_method"):
        with pytest.raises(AttributeError, match="not a public method of Worker"):
            executor.collective_rpc(private)


def test_a_blocking_step_gives_the_non_blocking_step_s_tokens(llama_path, expected):
    """The core's step (``expected``) asks for the forward non-blocking; here it blocks, and the
    tokens are the same."""
    llm = LLM(str(llama_path), **ENGINE_ARGS)
    core = llm.engine.core
    for i, prompt in enumerate(_prompts()):
        llm.engine.add_request(str(i), prompt, _greedy())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(expected))}
    while core.has_unfinished_requests():
        scheduler_output = core.scheduler.schedule()
        assert core.executor.execute_model(scheduler_output) is None
        runner_output = core.executor.sample_tokens(core.scheduler.grammar_bitmask(scheduler_output))
        for out in core.scheduler.update_from_output(scheduler_output, runner_output):
            tokens[out.req_id] += out.new_token_ids
    assert [tokens[str(i)] for i in range(len(expected))] == expected


def test_a_non_blocking_forward_returns_a_completed_future_in_process(default_llm):
    core = default_llm.engine.core
    core.add_request(default_llm.engine.prepare_request("f", _prompts(1)[0], _greedy()).requests[0])
    scheduler_output = core.scheduler.schedule()
    future = core.executor.execute_model(scheduler_output, non_block=True)
    assert future.done() and future.result() == [None]
    runner_output = core.executor.sample_tokens(None)
    assert list(runner_output.sampled) == ["f"]
    core.scheduler.update_from_output(scheduler_output, runner_output)
    core.finish_requests(["f"], RequestStatus.FINISHED_ABORTED)


def test_the_worker_spec_pickles_and_names_the_loaded_plugins(default_llm, llama_path):
    spec = default_llm.engine.core.worker_spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert (spec.model_path, spec.dtype, spec.max_model_len, spec.rank, spec.world_size) == (
        str(llama_path), "float32", 128, 0, 1)
    assert {"cpu", "sdpa", "llama"} <= set(spec.plugins) and "tokenmill-core-defaults" not in spec.plugins
    assert spec.config.distributed_executor_backend == "uni"


def _batch_tokens(worker: Worker) -> list[list[int]]:
    """The token ids of every live row of the worker's persistent batch: its next inputs come from them."""
    batch = worker.runner.batch
    return [batch.token_ids[row, : batch.num_tokens[row]].tolist() for row in range(batch.num_reqs)]


def _row_ids(worker: Worker) -> list[str]:
    batch = worker.runner.batch
    return [batch.states[row].req_id for row in range(batch.num_reqs)]


def _kv_caches(worker: Worker) -> list[torch.Tensor]:
    return [tensor.clone() for cache in worker.runner.kv_caches for tensor in cache]


def test_ranks_built_from_an_unpickled_spec_generate_and_only_rank_0_samples(llama_path, expected):
    """Two ranks, each with its own plugins, platform and weights loaded from the spec alone. The
    KV cache is small enough to preempt, so requests resume too. Rank 1 runs every forward (its KV
    cache is rank 0's, bit for bit) and returns no tokens; it learns the sampled ones from the
    scheduler's diffs: after a step its batch lacks only the tokens rank 0 has just sampled."""
    llm = LLM(str(llama_path), distributed_executor_backend="in-process-ranks", dtype="float32", max_model_len=128,
              num_kv_blocks=10)
    core, executor = llm.engine.core, llm.engine.core.executor
    assert [w.spec.rank for w in executor.workers] == [0, 1] and executor.workers[1].spec.world_size == 2
    assert executor.workers[0].plugins is not core.plugins  # rebuilt from the names in the spec
    for i, prompt in enumerate(_prompts()):
        llm.engine.add_request(str(i), prompt, _greedy())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(expected))}
    while core.has_unfinished_requests():
        scheduler_output = core.scheduler.schedule()
        assert executor.collective_rpc("execute_model", (scheduler_output,)) == [None, None]
        rank0, rank1 = executor.collective_rpc("sample_tokens", (None,))
        assert rank1 == ModelRunnerOutput()
        for out in core.scheduler.update_from_output(scheduler_output, rank0):
            tokens[out.req_id] += out.new_token_ids
        batch0, batch1 = executor.collective_rpc(_batch_tokens)
        sampled = [len(rank0.sampled.get(req_id, [])) for req_id in _row_ids(executor.workers[0])]
        assert batch1 == [row[: len(row) - n] for row, n in zip(batch0, sampled, strict=True)]
        caches0, caches1 = executor.collective_rpc(_kv_caches)
        assert all(torch.equal(a, b) for a, b in zip(caches0, caches1, strict=True))
    assert [tokens[str(i)] for i in range(len(expected))] == expected
    assert core.make_stats().num_preemptions > 0
    assert any(bool(a.any()) for a in caches0)


def test_ranks_generate_through_the_engine_like_one_worker(llama_path, expected):
    llm = LLM(str(llama_path), distributed_executor_backend="in-process-ranks", **ENGINE_ARGS)
    assert _tokens(llm) == expected


def test_the_kv_cache_fits_the_rank_with_least_room(llama_path):
    """Rank 1 of ``in-process-ranks`` has half the KV memory: the blocks are counted from it."""
    llm = LLM(str(llama_path), distributed_executor_backend="in-process-ranks", dtype="float32", max_model_len=128,
              kv_cache_memory="8MiB")
    executor = llm.engine.core.executor
    assert executor.collective_rpc("kv_cache_budget") == [8 << 20, 4 << 20]
    assert llm.engine.model_info.num_kv_blocks == (4 << 20) // executor.kv_bytes_per_block()


def test_a_worker_built_from_a_rank_1_spec_runs_without_sampling(default_llm):
    spec: WorkerSpec = pickle.loads(pickle.dumps(default_llm.engine.core.worker_spec.for_rank(1)))
    worker = Worker(spec)
    assert not spec.samples and not worker.runner.samples
    assert Worker(spec.for_rank(0), plugins=worker.plugins, platform=worker.platform).runner.samples


def test_model_info_matches_the_checkpoint(default_llm, llama_path):
    info = default_llm.engine.model_info
    config = json.loads((llama_path / "config.json").read_text())
    tokenizer = default_llm.get_tokenizer()
    assert info.path == str(llama_path)
    assert info.architecture == config["architectures"][0] == "LlamaForCausalLM"
    assert info.vocab_size == config["vocab_size"]
    assert info.max_model_len == 128
    assert info.eos_token_id == tokenizer.eos_token_id
    assert info.stop_token_ids[0] == tokenizer.eos_token_id
    assert (info.dtype, info.device_type, info.block_size) == ("float32", "cpu", 16)
    assert info.num_kv_blocks == default_llm.engine.scheduler_stats.kv_blocks_total
    assert default_llm.engine.core.model_info() is info


class _StartRecorder:
    """A plugin registered in code, recording the process-start calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    @hookimpl
    def tokenmill_process_start(self, role: str, rank: int) -> None:
        self.calls.append((role, rank))


def _manager_with(plugin: object) -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points()
    manager.register(plugin, PluginInfo("start-recorder", "tests", "0", __name__))
    return manager


def test_process_start_is_called_for_the_engine_and_its_worker(llama_path):
    recorder = _StartRecorder()
    LLMEngine(EngineConfig(model=str(llama_path), **ENGINE_ARGS), plugins=_manager_with(recorder))
    assert recorder.calls == [("engine", 0), ("worker", 0)]


def test_a_plugin_registered_in_code_cannot_reach_a_worker_built_from_the_spec(llama_path):
    config = EngineConfig(model=str(llama_path), distributed_executor_backend="in-process-ranks", **ENGINE_ARGS)
    with pytest.raises(PluginError, match=r"worker rank 0 could not load the engine's plugins \['start-recorder'\]"):
        LLMEngine(config, plugins=_manager_with(_StartRecorder()))
