"""The eagle proposer end to end, with a random-weight EAGLE-1 head in the published on-disk
layout: greedy output token-identical to no speculation and to transformers (float32, eight
prompts, with and without chunked prefill, prefix caching and preemption in play); the drafts
are what transformers computes from the target's hidden states (so the runner hands the head
the right ones); sampled tokens keep the target's distribution; a head of another hidden size
fails the start."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle_heads import build_eagle_head, hf_eagle_draft_logits, hf_eagle_drafts
from test_spec_decode import (
    MAX_NEW,
    SEEDS,
    TV_BOUND,
    _engine,
    _greedy,
    _repetitive_prompts,
    _second_tokens,
    _tokens_and_logprobs,
    _total_variation,
    plain_second_tokens,  # noqa: F401  (a fixture)
)
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.proposer import DraftRequest, TargetHiddenStates


@pytest.fixture(scope="module")
def eagle_head(llama_path, tmp_path_factory):
    return build_eagle_head(tmp_path_factory.mktemp("eagle"), llama_path)


def _eagle(head, k: int = 3) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


@pytest.mark.parametrize("chunked", [True, False])
def test_eagle_greedy_is_token_identical_to_no_speculation_and_transformers(llama_path, eagle_head, chunked):
    prompts = _repetitive_prompts()
    budget = {} if chunked else {"max_num_batched_tokens": 512}  # 48 cuts the longer prompts into chunks
    plain = _tokens_and_logprobs(_engine(llama_path, **budget).generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy()))
    llm = _engine(llama_path, _eagle(eagle_head), **budget)
    ours = _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    reference = hf_greedy(llama_path, prompts, MAX_NEW)
    for i, ((tokens, logprobs), (plain_tokens, _), (hf_tokens, hf_logprobs)) in enumerate(
            zip(ours, plain, reference, strict=True)):
        assert tokens == plain_tokens == hf_tokens, f"prompt {i}: EAGLE changed the greedy tokens"
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-3)
    core = llm.engine.core
    stats = core.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert core.kv_manager.num_free_blocks == core.num_kv_blocks  # every slot given back
    # a random head's drafts almost never hit: the off-switch pauses requests (output unchanged)
    assert core.scheduler.draft_backoff.num_pauses > 0


def _record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every (context, drafts) the engine's EAGLE proposer returns from now on."""
    proposer = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner.spec_decode.proposer)[0]
    calls: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(requests):
        drafts = propose(requests)
        calls.extend((r.token_ids.tolist(), d) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = recording
    return calls


@pytest.mark.parametrize("bin_format", [False, True])
def test_eagle_drafts_are_what_transformers_computes_from_the_targets_hidden_states(
        llama_path, eagle_head, tmp_path, bin_format):
    """Through chunked prefills (hidden states of steps that do not sample) and rejected drafts
    (hidden states of the accepted positions only), every draft is transformers' computation of
    the head over the target's hidden states of the whole context. The head also loads from
    ``pytorch_model.bin``, with the ``fc.bias`` of the first published heads."""
    head = build_eagle_head(tmp_path / "bin", llama_path, bin_format=True, fc_bias=True) if bin_format else eagle_head
    llm = _engine(llama_path, _eagle(head), enable_prefix_caching=False, max_num_batched_tokens=16,
                  num_kv_blocks=None, kv_cache_memory="16MiB")
    calls = _record_proposals(llm)
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()[4:7]]
    llm.generate(prompts, _greedy(10))
    assert len(calls) >= 3 * 3
    for context, drafts in calls:
        assert drafts, "a request that sampled got no drafts"
        assert drafts == hf_eagle_drafts(llama_path, head, context, len(drafts)), f"context of {len(context)}"


def test_sampled_tokens_keep_their_distribution_with_eagle(llama_path, eagle_head, plain_second_tokens):  # noqa: F811
    llm = _engine(llama_path, _eagle(eagle_head, 1), max_num_seqs=64, num_kv_blocks=None, kv_cache_memory="64MiB")
    assert _total_variation(_second_tokens(llm), plain_second_tokens) < TV_BOUND
    assert llm.engine.core.make_stats().spec_decode_num_draft_tokens >= SEEDS


def test_sampled_eagle_drafts_come_with_the_heads_softmax_at_the_request_temperature(llama_path, eagle_head):
    """A sampled request's drafts are drawn from, and handed over with, the softmax at its
    temperature and top-k of transformers' head logits; a greedy one beside it keeps the argmax."""
    from transformers import AutoModelForCausalLM

    llm = _engine(llama_path, _eagle(eagle_head, 2))
    proposer = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner.spec_decode.proposer)[0]
    context = _repetitive_prompts()[1]
    with torch.no_grad():
        hidden = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).model(
            torch.tensor([context])).last_hidden_state[0]
    sampled = SamplingParams(temperature=0.8, top_k=8, seed=5)
    for req_id in ("sampled", "greedy"):
        proposer.observe([TargetHiddenStates(req_id, 0, hidden[:-1])])
    drafts = proposer.propose([DraftRequest("sampled", np.array(context), 2, sampled),
                               DraftRequest("greedy", np.array(context), 2, SamplingParams(temperature=0.0))])
    probs = proposer.take_draft_probs()
    assert set(probs) == {"sampled"}
    assert drafts[1] == hf_eagle_drafts(llama_path, eagle_head, context, 2)
    logits = hf_eagle_draft_logits(llama_path, eagle_head, context, drafts[0])
    for j, row in enumerate(logits):
        top = row.topk(8)
        expected = torch.zeros_like(row).index_put_((top.indices,), torch.softmax(top.values / 0.8, -1))
        assert probs["sampled"][j].cpu() == pytest.approx(expected, abs=1e-4)
        assert expected[drafts[0][j]] > 0


def test_a_head_of_another_hidden_size_fails_at_start(llama_path, tmp_path):
    head = build_eagle_head(tmp_path / "narrow", llama_path, hidden_size=32)
    with pytest.raises(ValueError, match="has hidden_size 32, the target 64"):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", speculative_config=_eagle(head))
