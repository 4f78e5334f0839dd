"""The Ray executor on a real local Ray cluster (127.0.0.1, two CPUs) that the tests start:
the tensor- and pipeline-parallel golden runs, and a rank's actor killed mid-generation."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from test_tensor_parallel import STRESS, _generate, _prompts
from tiny_models import hf_greedy
from worker_probe import worker_pids

from tokenmill import LLM, SamplingParams
from tokenmill.executor.remote_ranks import WorkerFailure
from tokenmill.plugin_api import process_alive

MAX_NEW = 10


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # the actors unpickle the tests' probes (tests/worker_probe.py) by module name
    tests = str(Path(__file__).parent)
    python_path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    yield ray
    ray.shutdown()


def test_ray_missing_is_a_clear_error_before_any_worker_starts(llama_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'tokenmill\[ray\]'"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
            distributed_executor_backend="ray")


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_two_ray_actors_match_one_rank_and_transformers(tp, pp, ray_cluster, model_factory):
    path = model_factory("qwen2")
    prompts = _prompts(3, shared_prefix=24)
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, MAX_NEW)]
    one_rank = _generate(LLM(str(path), **STRESS), prompts)
    assert one_rank[0] == expected
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray",
              **STRESS)
    tokens, entry_tokens, logprobs = _generate(llm, prompts)
    assert tokens == expected and entry_tokens == one_rank[1]
    assert logprobs == pytest.approx(one_rank[2], abs=1e-4)
    stats = llm.engine.scheduler_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    pids = worker_pids(llm)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)


def test_a_killed_ray_actor_fails_generate_and_leaves_no_process(ray_cluster, llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    pids = worker_pids(llm)
    started = threading.Event()

    def kill_rank_1() -> None:
        started.wait()
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    started.set()
    with pytest.raises(WorkerFailure, match=r"worker rank 1 \(Ray actor\) died"):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(4)] * 4,
                     SamplingParams(temperature=0.0, max_tokens=190, ignore_eos=True))
    killer.join()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)
