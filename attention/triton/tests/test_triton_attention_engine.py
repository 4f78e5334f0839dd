"""The engine with the Triton backend forced, on CPU tensors through Triton's
interpreter: greedy tokens and logprobs equal to transformers' on tiny random models
(Llama; Mistral's sliding window; Gemma 2's sliding window and soft cap), also with
chunked prefill and prefix caching.

Under ``TRITON_INTERPRET=1`` the plugin also offers its kernels for the CPU, as
``triton-interpreted`` at the lowest priority, so they run only when named; like the
kernel tests, the cases run in a child pytest that has the variable set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from family_models import build_family_model
from tiny_models import build_model, hf_greedy
from worker_probe import attention_backend

from tokenmill import LLM, SamplingParams

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
MAX_NEW = 6
PROMPTS = [[5, 77, 190, 3, 41], [12, 250, 9, 300, 18, 66, 101, 7, 222, 31, 4, 150, 88, 19, 260, 73, 5, 44, 90],
           list(range(40, 80)), [7] * 3 + list(range(200, 227))]


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_the_interpreted_engine_cases_pass_under_the_interpreter():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                            "interpreted"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "5 passed" in child.stdout, child.stdout[-2000:]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    built = {}

    def get(arch: str):
        if arch not in built:
            folder = tmp_path_factory.mktemp(arch)
            built[arch] = build_family_model(folder, arch) if arch.startswith("gemma") else build_model(folder, arch)
        return built[arch]

    return get


def _greedy_matches_transformers(path, prompts: list[list[int]], **options) -> LLM:
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
              attention_backend="triton-interpreted", **options)
    assert attention_backend(llm) == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, hf_greedy(path, prompts, MAX_NEW), strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i}: greedy tokens differ from transformers"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i}: logprobs differ"
    return llm


@interpreted_only
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_interpreted_greedy_matches_transformers(arch, model):
    _greedy_matches_transformers(model(arch), PROMPTS)


@interpreted_only
def test_interpreted_chunked_prefill_and_prefix_cache_match_transformers(model):
    shared = list(range(100, 140))
    prompts = [[*shared, 5, 6, 7], [*shared, 300, 301, 302, 303, 9]]
    llm = _greedy_matches_transformers(model("llama"), prompts[:1], max_num_batched_tokens=16,
                                       enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params)[0]
    assert second.num_cached_tokens >= 32  # its prefix came from the cache, its rest in chunks of 16
    assert second.outputs[0].token_ids == hf_greedy(model("llama"), prompts[1:], MAX_NEW)[0][0]


@interpreted_only
def test_interpreted_backend_is_never_chosen_unasked(model):
    llm = LLM(str(model("llama")), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    assert attention_backend(llm) != "triton"
