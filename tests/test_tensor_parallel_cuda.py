"""Tensor parallelism on CUDA: NCCL, one process per GPU. Run by scripts/gpu-check.

Two ranks need two GPUs (the two-rank tests skip on a one-GPU machine); one rank in a
process of its own (the "mp" executor with tensor_parallel_size=1) runs wherever there is
one GPU, and checks the half of the path that does not need a second device: the spawned
rank finds its device from LOCAL_RANK, joins an NCCL group, and samples on the GPU.
Greedy tokens are compared with transformers on the CPU in float32 (the ground truth).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy
from worker_probe import worker_pids

from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

MAX_NEW = 8
PROMPTS = [[5, 17, 33, 8, 91], [120, 7, 44, 3, 9, 60, 61, 62, 63], [11, 12, 13], [200, 201, 9, 9, 4, 77, 31]]
OPTIONS = dict(dtype="float32", max_model_len=128, kv_cache_memory="64MiB", max_num_batched_tokens=16,
               enable_prefix_caching=True)


def _device_of_rank(worker: object) -> tuple[str, int, str]:
    import torch.distributed as dist

    device = worker.runner.device  # type: ignore[attr-defined]
    return device.type, device.index, dist.get_backend()


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-one-kv-head"])
@two_gpus
def test_two_ranks_on_two_gpus_match_transformers(arch, model_factory):
    path = model_factory(arch)
    expected = [tokens for tokens, _ in hf_greedy(path, PROMPTS, MAX_NEW)]
    llm = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.engine.core.executor.collective_rpc(_device_of_rank) == [("cuda", 0, "nccl"), ("cuda", 1, "nccl")]
        assert _greedy(llm) == expected
        stats = llm.engine.core.executor.collective_rpc("communication_stats")
        assert stats[0]["comm_calls"] == stats[1]["comm_calls"] > 0
    finally:
        llm.engine.shutdown()


def test_one_rank_in_its_own_process_runs_on_its_gpu_over_nccl(llama_path):
    expected = [tokens for tokens, _ in hf_greedy(llama_path, PROMPTS, MAX_NEW)]
    llm = LLM(str(llama_path), distributed_executor_backend="mp", **OPTIONS)
    try:
        assert llm.engine.core.executor.collective_rpc(_device_of_rank) == [("cuda", 0, "nccl")]
        assert len(worker_pids(llm)) == 1
        assert _greedy(llm) == expected
    finally:
        llm.engine.shutdown()
