"""Tensor parallelism: the parallel layers' rank slices, and real worker processes over gloo.

The layer tests build two ranks' layers in this process from two build contexts whose
communicator is the one-rank no-op, and do the collective by hand (summing row-parallel
partials, concatenating column slices), against the unsplit layer. The engine tests
start the "mp" executor: two spawned processes joined over TCP on 127.0.0.1.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import hf_greedy
from worker_probe import worker_pids

from tokenmill import LLM, SamplingParams
from tokenmill.executor.remote_ranks import WorkerFailure
from tokenmill.executor.tensor_parallel import check_tensor_parallel
from tokenmill.layers import Linear, MergedLinear, ModelBuildContext, ParallelLMHead, VocabEmbedding, load_weight
from tokenmill.plugin_api import process_alive

MAX_NEW = 10


def _contexts(world_size: int = 2) -> list[ModelBuildContext]:
    return [ModelBuildContext(hf_config=None, rank=r, world_size=world_size, params_dtype=torch.float32)
            for r in range(world_size)]


def _load(layer: torch.nn.Module, name: str, tensors: list[torch.Tensor]) -> None:
    param = getattr(layer, name)
    if len(tensors) == 1:
        load_weight(param, tensors[0])
    for shard, tensor in enumerate(tensors if len(tensors) > 1 else []):
        load_weight(param, tensor, shard)


def test_column_parallel_merged_qkv_with_replicated_kv_heads():
    """q of 4 heads splits over 4 ranks, k/v of 2 heads are replicated on ranks (0, 1) and (2, 3)."""
    torch.manual_seed(0)
    head, hidden = 2, 6
    q, k, v = torch.randn(4 * head, hidden), torch.randn(2 * head, hidden), torch.randn(2 * head, hidden)
    bias = [torch.randn(4 * head), torch.randn(2 * head), torch.randn(2 * head)]
    x = torch.randn(3, hidden)
    full = MergedLinear(hidden, [4 * head, 2 * head, 2 * head], bias=True,
                        ctx=ModelBuildContext(hf_config=None, params_dtype=torch.float32))
    _load(full, "weight", [q, k, v])
    _load(full, "bias", bias)
    fq, fk, fv = full.split(full(x))
    for rank, ctx in enumerate(_contexts(4)):
        layer = MergedLinear(hidden, [4 * head, 2 * head, 2 * head], bias=True, ctx=ctx, parallel="column",
                             shard_parts=[4, 2, 2])
        assert layer.output_partition_sizes == [head, head, head]
        _load(layer, "weight", [q, k, v])
        _load(layer, "bias", bias)
        rq, rk, rv = layer.split(layer(x))
        kv_head = rank // 2
        torch.testing.assert_close(rq, fq[:, rank * head:(rank + 1) * head], rtol=0, atol=1e-6)
        torch.testing.assert_close(rk, fk[:, kv_head * head:(kv_head + 1) * head], rtol=0, atol=1e-6)
        torch.testing.assert_close(rv, fv[:, kv_head * head:(kv_head + 1) * head], rtol=0, atol=1e-6)


def test_row_parallel_partials_sum_to_the_whole_layer_with_the_bias_once():
    torch.manual_seed(1)
    weight, bias, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    full = Linear(8, 5, bias=True, ctx=ModelBuildContext(hf_config=None, params_dtype=torch.float32))
    _load(full, "weight", [weight])
    _load(full, "bias", [bias])
    partials = []
    for rank, ctx in enumerate(_contexts()):
        layer = Linear(8, 5, bias=True, ctx=ctx, parallel="row")
        _load(layer, "weight", [weight])
        _load(layer, "bias", [bias])
        assert layer.in_features == 4 and torch.equal(layer.weight, weight[:, rank * 4:(rank + 1) * 4])
        partials.append(layer(x[:, rank * 4:(rank + 1) * 4]))  # the no-op communicator: the partial sum
    torch.testing.assert_close(partials[0] + partials[1], full(x), rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_pads_the_last_rank_and_looks_up_each_id_once():
    torch.manual_seed(2)
    table = torch.randn(7, 3)  # 7 rows over 2 ranks: 4 each, rank 1's last row is padding
    ids = torch.tensor([0, 3, 4, 6, 2])
    lookups = []
    for ctx in _contexts():
        embedding = VocabEmbedding(7, 3, ctx=ctx, parallel=True)
        load_weight(embedding.weight, table)
        assert embedding.weight.shape == (4, 3)
        lookups.append(embedding(ids))
    assert torch.equal(lookups[0] + lookups[1], table[ids])


def test_parallel_lm_head_slices_concatenate_to_the_whole_logits():
    torch.manual_seed(3)
    weight, hidden = torch.randn(7, 3), torch.randn(2, 3)
    slices = []
    for ctx in _contexts():
        head = ParallelLMHead(3, 7, ctx=ctx)
        load_weight(head.weight, weight)
        assert head.weight.shape == (4, 3)
        slices.append(head.quant_method.apply(head, hidden))  # this rank's slice, before the all-gather
    whole = ParallelLMHead(3, 7, ctx=ModelBuildContext(hf_config=None, params_dtype=torch.float32))
    load_weight(whole.weight, weight)
    torch.testing.assert_close(torch.cat(slices, dim=-1)[:, :7], whole(hidden), rtol=0, atol=1e-6)
    assert torch.equal(torch.cat(slices, dim=-1)[:, 7], torch.zeros(2))  # the padding row


def test_one_rank_layers_are_the_unsplit_layers():
    """A parallel layer built for a group of one is today's layer: same shapes, same loader slices."""
    ctx = ModelBuildContext(hf_config=None, params_dtype=torch.float32)
    for parallel in ("column", "row"):
        layer = Linear(8, 6, ctx=ctx, parallel=parallel)
        assert (layer.parallel, layer.in_features, layer.out_features) == ("none", 8, 6)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "message"), [
    (4, 2, 3, "does not divide the model's 4 attention heads"),
    (12, 6, 4, "does not divide the model's 6 KV heads"),
    (12, 4, 6, "is not a multiple of the model's 4 KV heads"),
])
def test_splits_that_do_not_divide_are_clear_errors(heads, kv_heads, tp, message):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=48)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, tp)
    check_tensor_parallel(config, 1)


def test_a_bad_tensor_parallel_size_fails_before_any_worker_starts(llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
            distributed_executor_backend="uni")


def test_more_ranks_than_gpus_is_an_error_before_any_worker_starts(llama_path):
    from tokenmill.config import EngineConfig
    from tokenmill.executor.multiproc import MultiprocExecutor
    from tokenmill.worker.spec import WorkerSpec
    from tokenmill_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform()
    config = EngineConfig(model=str(llama_path), tensor_parallel_size=platform.device_count() + 1)
    spec = WorkerSpec(str(llama_path), config, "float32", 128, (), world_size=config.tensor_parallel_size)
    with pytest.raises(ValueError, match=rf"needs a device per rank; the cuda platform has {platform.device_count()}"):
        MultiprocExecutor(spec, platform=platform)
    assert multiprocessing.active_children() == []


def _prompts(seed: int, count: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 380) for _ in range(shared_prefix)]
    lengths = [5, 9, 17, 23, 31, 40, 47, 60][:count]
    return [prefix + [rng.randrange(3, 380) for _ in range(n)] for n in lengths]


def _greedy(prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1,
                          prompt_logprobs=prompt_logprobs)


def _generate(llm: LLM, prompts: list[list[int]], prompt_logprobs: int | None = None,
              ) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Greedy tokens; the token ids of every step's (and prompt position's) logprob entries;
    their logprobs, flattened."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(prompt_logprobs))
    entry_tokens, logprobs = [], []
    for out in outputs:
        for step in [*out.outputs[0].logprobs, *(out.prompt_logprobs or [None])[1:]]:
            entries = sorted(step.items())
            entry_tokens.append([token for token, _ in entries])
            logprobs += [entry.logprob for _, entry in entries]
    return [list(out.outputs[0].token_ids) for out in outputs], entry_tokens, logprobs


# chunks of 16 tokens, prefix caching, and 10 blocks of 16 tokens for 8 prompts of up to 84:
# chunked prefill, prefix-cache hits and preemptions all happen in one run
STRESS = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, enable_prefix_caching=True,
              num_kv_blocks=10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-one-kv-head", "llama-tied-llama3rope"])
def test_two_ranks_match_one_rank_and_transformers(arch, model_factory):
    """Greedy tokens equal transformers' and one rank's; the logprobs (sampled ones, then
    prompt ones too: rank 0 computes both through the gathered lm_head) equal one rank's."""
    path = model_factory(arch)
    prompts = _prompts(3, shared_prefix=24)
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, MAX_NEW)]
    one_rank_llm = LLM(str(path), **STRESS)
    one_rank = _generate(one_rank_llm, prompts)
    assert one_rank[0] == expected
    llm = LLM(str(path), tensor_parallel_size=2, **STRESS)
    assert llm.engine.config.distributed_executor_backend == "mp"
    tokens, entry_tokens, logprobs = _generate(llm, prompts)
    assert tokens == expected and entry_tokens == one_rank[1]
    assert logprobs == pytest.approx(one_rank[2], abs=1e-4)
    stats = llm.engine.scheduler_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    with_prompt = _generate(llm, prompts[:3], prompt_logprobs=2)
    one_rank_with_prompt = _generate(one_rank_llm, prompts[:3], prompt_logprobs=2)
    assert with_prompt[:2] == one_rank_with_prompt[:2]
    assert with_prompt[2] == pytest.approx(one_rank_with_prompt[2], abs=1e-4)
    pids = worker_pids(llm)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    llm.engine.shutdown()
    assert not any(process_alive(pid) for pid in pids)


def test_a_killed_worker_fails_the_engine_quickly_and_leaves_no_process(llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", tensor_parallel_size=2)
    pids = worker_pids(llm)
    started = threading.Event()
    params = SamplingParams(temperature=0.0, max_tokens=190, ignore_eos=True)  # seconds of decoding

    def kill_rank_1() -> None:
        started.wait()
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    started.set()
    with pytest.raises(WorkerFailure, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(4)] * 4, params)
    killer.join()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)


def test_a_killed_worker_stops_the_async_engine_and_fails_its_requests(llama_path):
    """What /health reads: the engine loop is dead, with the rank's death as its reason, and
    every stream in flight ends with that error, within seconds."""
    import asyncio

    from tokenmill import AsyncLLM
    from tokenmill.errors import EngineDeadError

    engine = AsyncLLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                      tensor_parallel_size=2)
    try:
        pids = worker_pids(engine)
        params = SamplingParams(temperature=0.0, max_tokens=190, ignore_eos=True)

        async def one(prompt: list[int]) -> None:
            async for _ in engine.generate({"prompt_token_ids": prompt}, params):
                pass

        async def run() -> list[BaseException | None]:
            tasks = [asyncio.ensure_future(one(p)) for p in _prompts(5)]
            await asyncio.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)

        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) and "worker rank 1" in str(r) for r in results), results
        assert not engine.is_running and "worker rank 1" in (engine.dead_reason or "")
        assert not any(process_alive(pid) for pid in pids)
    finally:
        engine.shutdown()


ENGINE_THEN_SIGKILL = """
import os, signal, sys, threading
from tokenmill import LLM, SamplingParams
from worker_probe import worker_pids

llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory="32MiB", tensor_parallel_size=2)
print(*worker_pids(llm), flush=True)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 16, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
"""


def test_a_killed_engine_leaves_no_worker_behind(llama_path):
    """The engine's process SIGKILLed mid-generation (no atexit, no finalizer): its ranks exit
    on their own once their pipe to it is closed."""
    import subprocess
    import sys

    tests = str(Path(__file__).parent)  # where worker_probe is; pytest's pythonpath does not reach a child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", ENGINE_THEN_SIGKILL, str(llama_path)], capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)
