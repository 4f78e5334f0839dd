"""Pipeline parallelism: the model's decoder layers split into stages, one worker process each
(times the tensor-parallel ranks of a stage), the hidden states sent stage to stage over gloo.

The engine tests start the "mp" executor with real processes on 127.0.0.1 and compare greedy
tokens with transformers and with one rank, under chunked prefill, prefix-cache hits and
preemption (the ``STRESS`` settings of the tensor-parallel tests).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_tensor_parallel import STRESS, _generate, _prompts
from tiny_models import hf_greedy
from worker_probe import worker_pids

from tokenmill import LLM, SamplingParams
from tokenmill.executor.pipeline_parallel import check_pipeline_parallel
from tokenmill.executor.remote_ranks import WorkerFailure
from tokenmill.layers import PipelineStage
from tokenmill.plugin_api import process_alive

MAX_NEW = 10


def test_stages_take_contiguous_layers_the_first_ones_one_more():
    ranges = [PipelineStage(rank, 3).layer_range(7) for rank in range(3)]
    assert ranges == [range(0, 3), range(3, 5), range(5, 7)]
    assert [PipelineStage(rank, 2).layer_range(2) for rank in range(2)] == [range(0, 1), range(1, 2)]
    assert PipelineStage().layer_range(5) == range(5)


class _BuildsWhole:
    """A model class that does not build by stage."""


class _BuildsByStage:
    supports_pipeline_parallel = True


def test_sizes_the_model_cannot_take_are_clear_errors():
    config = SimpleNamespace(num_hidden_layers=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 layers"):
        check_pipeline_parallel(config, _BuildsByStage, 3)
    with pytest.raises(ValueError, match="_BuildsWhole does not split into pipeline stages"):
        check_pipeline_parallel(config, _BuildsWhole, 2)
    check_pipeline_parallel(config, _BuildsByStage, 2)
    check_pipeline_parallel(config, _BuildsWhole, 1)


def test_more_stages_than_layers_fail_before_any_worker_starts(llama_path):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 layers"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, pipeline_parallel_size=3)
    assert multiprocessing.active_children() == []


def _collectives_on_rank(rank: int, port: int, results: Any) -> None:
    """One of two gloo ranks: broadcast, gather to rank 0, and a send/recv round trip."""
    import torch
    import torch.distributed as dist

    from tokenmill.layers import Communicator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = Communicator(rank, 2)
    broadcast = comm.broadcast(torch.full((2,), float(rank + 5)), src=1)
    gathered = comm.gather(torch.full((1, 2), float(rank)), dst=0, dim=-1)
    if rank == 0:
        comm.send(torch.arange(3.0), dst=1)
        echoed = comm.recv(torch.empty(3), src=1)
    else:
        echoed = comm.recv(torch.empty(3), src=0)
        comm.send(echoed * 2, dst=0)
    results.put((rank, broadcast.tolist(), gathered.tolist(), echoed.tolist()))
    dist.destroy_process_group()


def test_communicator_broadcast_gather_send_recv_between_two_processes():
    from tokenmill.executor.multiproc import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_collectives_on_rank, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    answers = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in processes))
    for process in processes:
        process.join(30)
    assert answers[0] == [[6.0, 6.0], [[0.0, 0.0, 1.0, 1.0]], [0.0, 2.0, 4.0]]
    assert answers[1] == [[6.0, 6.0], [[1.0, 1.0]], [0.0, 1.0, 2.0]]  # a rank other than dst keeps its own


def _stage_contents(worker: Any) -> tuple[int, bool, bool, list[int]]:
    """(decoder layers whose KV cache this rank holds, whether it has the embedding, the lm_head;
    the layer index of every parameter it holds)."""
    names = [name for name, _ in worker.runner.model.named_parameters()]
    layers = sorted({int(name.split(".")[2]) for name in names if name.startswith("model.layers.")})
    return (len(worker.runner.kv_caches), any(n.startswith("model.embed_tokens.") for n in names),
            any(n.startswith("lm_head.") for n in names), layers)


@pytest.mark.parametrize(("arch", "tp", "pp"), [
    ("llama", 1, 2),
    ("llama-tied-llama3rope", 1, 2),  # the last stage loads the embedding's table into its own lm_head
    ("qwen2", 2, 2),  # four processes: two stages of two tensor-parallel ranks
])
def test_stages_match_one_rank_and_transformers(arch, tp, pp, model_factory):
    path = model_factory(arch)
    prompts = _prompts(3, shared_prefix=24)
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, MAX_NEW)]
    one_rank = _generate(LLM(str(path), **STRESS), prompts)
    assert one_rank[0] == expected
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **STRESS)
    assert llm.engine.config.distributed_executor_backend == "mp"
    tokens, entry_tokens, logprobs = _generate(llm, prompts)
    assert tokens == expected and entry_tokens == one_rank[1]
    assert logprobs == pytest.approx(one_rank[2], abs=1e-4)
    stats = llm.engine.scheduler_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    micro_batches = llm.engine.core.micro_batches.stats
    assert micro_batches.sent > micro_batches.fills  # steps were sent while another was in flight
    _abort_one_in_flight(llm, prompts[:4], expected[:4])
    contents = llm.engine.core.executor.collective_rpc(_stage_contents)
    # ranks are stage-major: stage 0 holds layer 0 and the embedding, stage 1 layer 1 and the head
    assert contents == [(1, True, False, [0])] * tp + [(1, False, True, [1])] * tp
    pids = worker_pids(llm)
    assert len(set(pids)) == tp * pp and os.getpid() not in pids
    llm.engine.shutdown()
    assert not any(process_alive(pid) for pid in pids)


def _abort_one_in_flight(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The prompts step by step; the first request seen in a step in flight is aborted there. The
    others' greedy tokens are still ``expected``, and every KV block comes back."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [engine.next_request_id() for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    aborted = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        in_flight = sorted(engine.core.micro_batches.in_flight_request_ids() & set(ids) - set(tokens))
        if aborted is None and in_flight:
            aborted = in_flight[0]
            engine.abort_request(aborted)
    assert aborted is not None
    assert {i: tokens[i] for i in ids if i != aborted} == {i: e for i, e in zip(ids, expected, strict=True) if i != aborted}
    stats = engine.core.make_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not engine.core.has_unfinished_requests()


@pytest.mark.parametrize("killed_stage", [0, 1])
def test_a_killed_stage_fails_generate_and_leaves_no_process(killed_stage, llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", pipeline_parallel_size=2)
    pids = worker_pids(llm)
    started = threading.Event()
    params = SamplingParams(temperature=0.0, max_tokens=190, ignore_eos=True)  # seconds of decoding

    def kill_stage() -> None:
        started.wait()
        time.sleep(0.3)
        os.kill(pids[killed_stage], signal.SIGKILL)

    killer = threading.Thread(target=kill_stage)
    killer.start()
    started.set()
    with pytest.raises(WorkerFailure, match=rf"worker rank {killed_stage} \(pid \d+\) died with exit code -9"):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(4)] * 4, params)
    killer.join()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)
