"""FP8 decode steps in the CPU platform's step graphs: the weight-only kernel's op
(``tokenmill_fp8::fp8_linear``) has an out overload the capture records, so every decode batch
size of an FP8 checkpoint (per channel and block-wise) replays from C++, sampling the tokens the
same engine samples eagerly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fp8_models import build_fp8_pair
from tiny_models import build_model
from worker_probe import runner

from tokenmill import LLM, SamplingParams
from tokenmill_quant_fp8.cpu_kernel import load_fp8_cpu_kernel

cpu_kernels = pytest.importorskip("tokenmill_platform_cpu.kernels")
pytestmark = pytest.mark.skipif(load_fp8_cpu_kernel() is None or not cpu_kernels.kernels_available(),
                                reason="needs the FP8 CPU kernel and the CPU platform's kernels")


@pytest.mark.parametrize("scheme", ["per-channel", "block"])
def test_fp8_decode_steps_replay_with_the_eager_tokens(tmp_path: Path, scheme: str) -> None:
    quantized = tmp_path / "fp8"
    build_fp8_pair(build_model(tmp_path / "llama", "llama"), quantized, tmp_path / "dequantized", scheme)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(4, 20))]} for _ in range(4)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(4)]

    def sampled(llm: LLM) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    options = {"dtype": "bfloat16", "max_model_len": 64, "kv_cache_memory": "8MiB"}
    graphed = LLM(str(quantized), **options)
    assert sampled(graphed) == sampled(LLM(str(quantized), enforce_eager=True, **options))
    graphs = runner(graphed).graphs
    assert graphs.batch_sizes == graphs.lm_head_batch_sizes == [1, 2, 3, 4]
    assert graphs.eager_batch_sizes == []
