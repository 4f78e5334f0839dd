"""Greedy output and logprobs of the non-Llama families (Gemma 2, Gemma 3, Phi-3) against
transformers ``generate`` on the same weights, as ``test_golden.py`` does for the Llama family:
float32, a batch of 8 prompts of 5 to 60 tokens, sliding windows shorter than most of them."""

from __future__ import annotations

import functools

import pytest
from family_models import build_family_model
from test_golden import _assert_matches, _generate, _greedy, _prompts
from tiny_models import hf_greedy
from worker_probe import attention_backend

from tokenmill import LLM
from tokenmill.errors import PluginError

MAX_NEW = 12


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    return functools.cache(lambda arch: build_family_model(tmp_path_factory.mktemp(arch), arch))


@pytest.fixture(scope="module")
def family_reference(family_model):
    return functools.cache(lambda arch: hf_greedy(family_model(arch), _prompts(1), MAX_NEW))


@pytest.mark.parametrize(("arch", "backend"), [
    ("gemma3", "sdpa"), ("gemma3", "cpu-paged"), ("gemma2", "sdpa"),
    ("gemma3-tied", "cpu-paged"), ("phi3", "sdpa"), ("phi3", "cpu-paged"),
])
def test_greedy_matches_transformers(arch, backend, family_model, family_reference):
    llm, outputs = _generate(family_model(arch), attention_backend=backend)
    assert attention_backend(llm) == backend
    _assert_matches(outputs, family_reference(arch))


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_longrope_matches_transformers_on_either_side_of_the_original_length(backend, family_model,
                                                                             family_reference):
    """LongRoPE with an original length of 20: prompts of 5 and 9 tokens stay within it (short
    factors), those of 23 to 60 are past it from the start (long factors). The 17-token prompt
    crosses it while decoding: transformers then recomputes the whole sequence with the long
    factors, tokenmill keeps its cached keys and rotates only the new tokens by them
    (docs/architecture.md), so it is compared up to the crossing."""
    original = 20
    _, outputs = _generate(family_model("phi3-longrope"), attention_backend=backend)
    expected = []
    for prompt, (tokens, logprobs) in zip(_prompts(1), family_reference("phi3-longrope"), strict=True):
        # token k comes from a forward over a sequence of len(prompt) + k tokens
        kept = original - len(prompt) + 1 if len(prompt) <= original < len(prompt) + MAX_NEW - 1 else MAX_NEW
        expected.append((tokens[:kept], logprobs[:kept]))
    for out, (tokens, _) in zip(outputs, expected, strict=True):
        out.outputs[0].token_ids = out.outputs[0].token_ids[: len(tokens)]
        out.outputs[0].logprobs = out.outputs[0].logprobs[: len(tokens)]
    assert sorted({len(tokens) for tokens, _ in expected}) == [4, MAX_NEW]  # one prompt crosses, at token 4
    _assert_matches(outputs, expected)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])
def test_chunked_prefill_of_16_tokens(arch, family_model, family_reference):
    """Prompt chunks of at most 16 tokens: a chunk's sliding-window layers attend to the
    cached keys of the chunks before it."""
    _, outputs = _generate(family_model(arch), max_num_batched_tokens=16)
    _assert_matches(outputs, family_reference(arch))


def test_soft_capped_model_gets_a_backend_that_caps(family_model):
    """Gemma 2 soft-caps its attention scores: the CPU platform's paged kernel does not,
    so the engine chooses SDPA on its own, and refuses the kernel when asked for it."""
    llm = LLM(str(family_model("gemma2")), dtype="float32", max_model_len=128, kv_cache_memory="32MiB")
    assert attention_backend(llm) == "sdpa"
    with pytest.raises(PluginError, match="cannot soft-cap attention scores"):
        LLM(str(family_model("gemma2")), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
            attention_backend="cpu-paged")


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])
def test_two_tensor_parallel_ranks_match_transformers(arch, family_model, family_reference):
    """Split over two ranks (gloo on the CPU): heads, the MLP and the vocabulary halved, Gemma 3's
    two K/V heads one per rank, Phi-3's fused q/k/v and gate/up cut into their shards first."""
    llm, outputs = _generate(family_model(arch), tensor_parallel_size=2)
    _assert_matches(outputs, family_reference(arch))
    llm.engine.shutdown()


def test_prefix_cache_hits_under_sliding_windows_match_transformers(family_model):
    """Six prompts behind one 40-token prefix: the later ones reuse its cached blocks, including
    blocks that their sliding-window layers no longer attend to, and keep transformers' tokens."""
    path = family_model("gemma3")
    prompts = _prompts(2, count=6, shared_prefix=40)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy())
    _assert_matches(first + rest, expected)
    assert all(out.num_cached_tokens >= 32 for out in rest), [o.num_cached_tokens for o in rest]
