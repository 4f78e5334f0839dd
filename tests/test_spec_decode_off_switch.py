"""Speculative decoding's off-switches end to end, with real proposers: a draft that never
agrees with the target stops being asked for drafts, then is probed again after a pause; a
draft that agrees keeps drafting; no drafts while the batch is larger than
``disable_by_batch_size``. Greedy output stays token-identical throughout."""

from __future__ import annotations

from itertools import pairwise

import pytest
from test_spec_decode import _engine, _greedy, _repetitive_prompts

from tokenmill import LLM
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.cost import VERIFY_TOKEN_COST, break_even_acceptance_rate

MAX_NEW = 40
SWITCH = {"min_acceptance_rate": 0.5, "acceptance_window": 4, "backoff_tokens": 4}


def _asked(llm: LLM) -> list[dict[str, int]]:
    """Every propose call from now on: each request asked for drafts, with its length then, and
    the requests in the worker's batch (under ``"batch"``)."""
    runner = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner)[0]
    proposer = runner.spec_decode.proposer
    calls: list[dict[str, int]] = []
    propose = proposer.propose

    def recording(requests):
        calls.append({"batch": len(runner.batch.index_of), **{r.req_id: len(r.token_ids) for r in requests}})
        return propose(requests)

    proposer.propose = recording
    return calls


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _repetitive_prompts()[:4]


@pytest.fixture(scope="module")
def plain(llama_path, prompts) -> list[list[int]]:
    return _generate(_engine(llama_path, num_kv_blocks=None, kv_cache_memory="16MiB"), prompts)


def _generate(llm: LLM, prompts: list[list[int]], max_new: list[int] | None = None) -> list[list[int]]:
    params = [_greedy(n) for n in max_new] if max_new else _greedy(MAX_NEW)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_a_draft_that_never_agrees_stops_being_asked_then_is_probed_again(llama_path, model_factory, prompts,
                                                                          plain):
    draft = {"model": str(model_factory("qwen2")), "num_speculative_tokens": 2, **SWITCH}  # random: shares nothing
    llm = _engine(llama_path, draft, num_kv_blocks=None, kv_cache_memory="16MiB")
    calls = _asked(llm)
    assert _generate(llm, prompts[:1]) == plain[:1]
    (req_id,) = {r for call in calls for r in call if r != "batch"}
    lengths = [call[req_id] for call in calls]
    gaps = [b - a for a, b in pairwise(lengths)]
    pauses = [g for g in gaps if g > 3]  # a step gives 3 tokens at most (2 drafts and one more): a pause
    assert len(pauses) >= 2, f"the proposer was asked at lengths {lengths}: never paused and probed again"
    assert pauses[1] > pauses[0], "a second low judgement in a row pauses longer"
    stats = llm.engine.core.make_stats()
    assert stats.spec_decode_num_paused_requests >= len(pauses) and stats.spec_decode_num_paused_steps > 0
    # drafts stop being made, not only verified: each proposal was verified but those of the judging
    # steps and of the last two (no room left under max_tokens)
    assert len(calls) <= stats.spec_decode_num_drafts + stats.spec_decode_num_paused_requests + 2


def test_a_draft_that_agrees_keeps_drafting(llama_path, prompts, plain):
    llm = _engine(llama_path, {"model": str(llama_path), "num_speculative_tokens": 2, **SWITCH},
                  num_kv_blocks=None, kv_cache_memory="16MiB")
    assert _generate(llm, prompts) == plain
    stats = llm.engine.core.make_stats()
    assert stats.spec_decode_num_paused_requests == stats.spec_decode_num_paused_steps == 0
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(llama_path, prompts, plain):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 2,
             "min_acceptance_rate": 0}
    llm = _engine(llama_path, ngram, num_kv_blocks=None, kv_cache_memory="16MiB")
    calls = _asked(llm)
    max_new = [8, 12, MAX_NEW, MAX_NEW]  # two finish early: the other two draft from then on
    assert _generate(llm, prompts, max_new) == [tokens[:n] for tokens, n in zip(plain, max_new, strict=True)]
    assert calls and max(call["batch"] for call in calls) <= 2, "the proposer was asked with more than 2 running"
    stats = llm.engine.core.make_stats()
    assert stats.spec_decode_num_steps_drafting_off > 0 and stats.spec_decode_num_draft_tokens > 0


def test_the_default_rate_is_where_drafting_breaks_even(llama_path):
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(llama_path)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert break_even_acceptance_rate(ngram, target) == VERIFY_TOKEN_COST  # a lookup costs nothing to draft
    itself = SpeculativeConfig(model=str(llama_path), num_speculative_tokens=3)
    assert break_even_acceptance_rate(itself, target) == 1.0  # a draft as dear as the target never pays
