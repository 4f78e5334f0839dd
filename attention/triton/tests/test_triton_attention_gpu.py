"""The Triton backend on a CUDA GPU (``-m gpu``, run by scripts/gpu-check): the kernel
cases against the SDPA reference in float32, bfloat16 and float16, larger batches
(64 decodes over 2k keys, long prompts, head size 128), and the engine's greedy tokens
against transformers (float32: identical; bfloat16: at least 95% of positions)."""

from __future__ import annotations

import pytest
import torch
from family_models import build_family_model
from tiny_models import build_model, hf_greedy
from triton_attention_cases import CASES, Case, build_inputs, run_backend, sdpa_reference
from worker_probe import attention_backend

from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("triton")

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
LARGE = {
    "decode-64x2k-head128-gqa4": Case(tuple((2048 - 17 * i, 1) for i in range(64)), num_heads=32, num_kv_heads=8,
                                      head_size=128),
    "prefill-2x1k-head128": Case(((0, 1024), (0, 700)), num_heads=16, num_kv_heads=16, head_size=128),
    "mixed-head64-block32": Case(((0, 300), (1500, 1), (900, 1), (600, 256), *((200 + i, 1) for i in range(30))),
                                 num_heads=16, num_kv_heads=4, head_size=64, block_size=32),
    # few long decodes: their keys are split among programs (flash-decoding), chosen per step
    "decode-1x8k-gqa4-split": Case(((8192, 1),), num_heads=32, num_kv_heads=8, head_size=128),
    "decode-3-window-split": Case(((6000, 1), (3000, 1), (50, 1)), num_heads=16, num_kv_heads=4, head_size=64,
                                  sliding_window=2048),
    "window-1k-soft-cap-head256": Case(((3000, 1), (2000, 40), (0, 600)), num_heads=8, num_kv_heads=4,
                                       head_size=256, sliding_window=1024, soft_cap=30.0, query_scale=4.0),
}


@pytest.fixture(scope="module")
def backend():
    from tokenmill_attn_triton.backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _check(backend, case: Case, dtype: torch.dtype) -> None:
    inputs = build_inputs(case, device="cuda", dtype=dtype)
    out, key_cache, value_cache = run_backend(backend, inputs)
    expected, expected_keys, expected_values = sdpa_reference(inputs)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(key_cache.float(), expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(value_cache.float(), expected_values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_small_cases_match_sdpa(name, dtype, backend):
    _check(backend, CASES[name], dtype)


def test_gpu_few_long_decodes_are_split():
    from tokenmill_attn_triton.backend import decode_splits

    assert decode_splits(8, 8192, torch.device("cuda", 0)) > 1
    assert decode_splits(64 * 8, 2048, torch.device("cuda", 0)) == 1  # 512 programs already fill the GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(LARGE))
def test_gpu_large_cases_match_sdpa(name, dtype, backend):
    _check(backend, LARGE[name], dtype)


PROMPTS = [[5, 77, 190, 3, 41], list(range(40, 80)), [12, 250, 9, 300, 18, 66, 101, 7, 222, 31, 4, 150, 88, 19],
           list(range(200, 260)), [7] * 3 + list(range(300, 327))]
MAX_NEW = 12


def _model(tmp_path_factory, arch: str):
    folder = tmp_path_factory.mktemp(arch)
    return build_family_model(folder, arch) if arch.startswith("gemma") else build_model(folder, arch)


def _generate(path, dtype: str, **options) -> list[list[int]]:
    llm = LLM(str(path), dtype=dtype, max_model_len=128, kv_cache_memory="64MiB", attention_backend="triton",
              **options)
    assert llm.engine.model_info.device_type == "cuda"
    assert attention_backend(llm) == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma2"])
def test_gpu_engine_float32_greedy_equals_transformers(arch, tmp_path_factory):
    path = _model(tmp_path_factory, arch)
    expected = [tokens for tokens, _ in hf_greedy(path, PROMPTS, MAX_NEW)]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", max_num_batched_tokens=16, enable_prefix_caching=True) == expected


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_gpu_engine_bfloat16_agrees_with_transformers_float32(arch, tmp_path_factory):
    path = _model(tmp_path_factory, arch)
    expected = [tokens for tokens, _ in hf_greedy(path, PROMPTS, MAX_NEW)]
    got = _generate(path, "bfloat16")
    same = sum(a == b for ours, theirs in zip(got, expected, strict=True) for a, b in zip(ours, theirs, strict=True))
    assert same >= 0.95 * len(PROMPTS) * MAX_NEW, (got, expected)
