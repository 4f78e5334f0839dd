"""bfloat16 on the CPU: the paged kernel's decode steps stay close to float32.

The bfloat16 engine's greedy tokens are fed to a float32 engine as a prompt; the
float32 prompt logprobs of those tokens (teacher forcing) are the reference for
the logprobs the bfloat16 engine reported while decoding them."""

from __future__ import annotations

import pytest
from test_golden import ARCHS, _prompts
from worker_probe import attention_backend

from tokenmill import LLM, SamplingParams


@pytest.mark.parametrize("arch", ARCHS)  # biases (Qwen2), q/k norms (Qwen3), a sliding window (Mistral), ropes
def test_bfloat16_decode_stays_close_to_float32(arch, model_factory):
    from tokenmill_platform_cpu.kernels import kernels_available

    if not kernels_available():
        pytest.skip("no C++ compiler: bfloat16 runs the SDPA reference backend")
    path = model_factory(arch)
    prompt = _prompts(7, count=4)[-1]
    bf16 = LLM(str(path), dtype="bfloat16", max_model_len=128, kv_cache_memory="16MiB")
    assert attention_backend(bf16) == "cpu-paged"
    completion = bf16.generate({"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))[0].outputs[0]
    tokens = list(completion.token_ids)
    f32 = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
    forced = f32.generate({"prompt_token_ids": prompt + tokens},
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    reference = [forced[len(prompt) + i][t].logprob for i, t in enumerate(tokens)]
    ours = [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]
    diffs = [abs(a - b) for a, b in zip(ours, reference, strict=True)]
    assert sum(diffs) / len(diffs) < 0.1, diffs  # a broken kernel is off by nats
