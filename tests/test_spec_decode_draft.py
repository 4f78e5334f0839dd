"""The draft_model proposer end to end: greedy output token-identical to no speculation and
to transformers, with chunked prefill, prefix caching and preemption in play; the target
itself as its draft is accepted (almost) always; a draft of another vocabulary fails the start."""

from __future__ import annotations

import json
import shutil

import pytest
from test_spec_decode import MAX_NEW, _engine, _greedy, _repetitive_prompts, _tokens_and_logprobs
from tiny_models import hf_greedy

from tokenmill import LLM


def test_draft_model_greedy_is_token_identical_and_the_target_as_draft_is_always_accepted(llama_path, model_factory):
    prompts = _repetitive_prompts()
    plain = _tokens_and_logprobs(_engine(llama_path).generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    llm = _engine(llama_path, {"model": str(llama_path), "num_speculative_tokens": 3})
    ours = _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    reference = hf_greedy(llama_path, prompts, MAX_NEW)
    for i, ((tokens, logprobs), (plain_tokens, _), (hf_tokens, hf_logprobs)) in enumerate(
            zip(ours, plain, reference, strict=True)):
        assert tokens == plain_tokens == hf_tokens, f"prompt {i}: the draft model changed the greedy tokens"
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-3)
    stats = llm.engine.core.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # the same weights propose what the target picks: all but float-rounding ties accepted
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_mean_accepted_length > 3


def test_another_family_as_draft(llama_path, model_factory):
    """A draft of another architecture (qwen2) with the same tokenizer: output unchanged."""
    prompts = _repetitive_prompts()[:4]
    plain = _engine(llama_path).generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    llm = _engine(llama_path, {"model": str(model_factory("qwen2")), "num_speculative_tokens": 2})
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]


def test_a_draft_with_another_vocabulary_or_fewer_positions_fails_at_start(llama_path, tmp_path):
    for key, value, message in [("vocab_size", 500, "vocabulary of 500 tokens"),
                                ("max_position_embeddings", 32, "32 positions, fewer than max_model_len=64")]:
        draft = tmp_path / key
        shutil.copytree(llama_path, draft)
        config = json.loads((draft / "config.json").read_text())
        config[key] = value
        (draft / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB",
                speculative_config={"model": str(draft), "num_speculative_tokens": 2})
