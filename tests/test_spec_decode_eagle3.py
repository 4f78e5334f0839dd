"""The eagle3 proposer end to end, with random-weight EAGLE-3 heads in the published on-disk
layout: greedy output token-identical to no speculation and to transformers (float32, eight
prompts, chunked prefill, prefix caching and preemption in play); every draft is what a plain
torch EAGLE-3 forward computes from transformers' hidden states of the target's layers (so the
Llama plugin records the right layers and the runner hands them over); a head built to predict
what its target predicts gets its drafts accepted; bad heads fail the start; the Llama, Gemma
and MoE plugins record the layers transformers computes."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_heads import (
    build_agreeing_eagle3_head,
    build_copying_target,
    build_eagle3_head,
    reference_eagle3_drafts,
    target_layer_states,
)
from test_spec_decode import MAX_NEW, _engine, _greedy, _repetitive_prompts, _tokens_and_logprobs
from test_spec_decode_eagle import _record_proposals
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def eagle3_head(llama_path, tmp_path_factory):
    return build_eagle3_head(tmp_path_factory.mktemp("eagle3"), llama_path)


def _eagle3(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def test_eagle3_greedy_is_token_identical_to_no_speculation_and_transformers(llama_path, eagle3_head):
    prompts = _repetitive_prompts()
    plain = _tokens_and_logprobs(_engine(llama_path).generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    llm = _engine(llama_path, _eagle3(eagle3_head))
    ours = _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    reference = hf_greedy(llama_path, prompts, MAX_NEW)
    for i, ((tokens, logprobs), (plain_tokens, _), (hf_tokens, hf_logprobs)) in enumerate(
            zip(ours, plain, reference, strict=True)):
        assert tokens == plain_tokens == hf_tokens, f"prompt {i}: EAGLE-3 changed the greedy tokens"
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-3)
    core = llm.engine.core
    stats = core.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert core.kv_manager.num_free_blocks == core.num_kv_blocks  # every slot given back


@pytest.mark.parametrize("own_embedding", [False, True])
def test_eagle3_drafts_are_the_reference_forward_over_the_targets_layers(llama_path, eagle3_head, tmp_path,
                                                                         own_embedding):
    """Through chunked prefills and rejected drafts, every draft is the plain EAGLE-3 forward
    over transformers' states of the target's layers 0, 1 and 2 for the whole context (with the
    target's embedding, or the head's own where it ships one)."""
    head = build_eagle3_head(tmp_path / "own", llama_path, seed=1, own_embedding=True) if own_embedding else eagle3_head
    llm = _engine(llama_path, _eagle3(head), enable_prefix_caching=False, max_num_batched_tokens=16,
                  num_kv_blocks=None, kv_cache_memory="16MiB")
    calls = _record_proposals(llm)
    llm.generate([{"prompt_token_ids": p} for p in _repetitive_prompts()[4:7]], _greedy(8))
    assert len(calls) >= 3 * 3
    for context, drafts in calls:
        assert drafts, "a request that sampled got no drafts"
        assert drafts == reference_eagle3_drafts(llama_path, head, context, len(drafts)), \
            f"context of {len(context)}"


def test_a_head_that_predicts_its_target_gets_its_drafts_accepted(llama_path, tmp_path):
    target = build_copying_target(tmp_path / "target", llama_path)
    head = build_agreeing_eagle3_head(tmp_path / "head", target)
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()[:4]]
    plain = [o.outputs[0].token_ids for o in _engine(target).generate(prompts, _greedy())]
    llm = _engine(target, {**_eagle3(head, 3), "min_acceptance_rate": 0})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == plain
    stats = llm.engine.core.make_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0.9 * stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize(("build", "config", "message"), [
    ({"hidden_size": 32}, {}, "has hidden_size 32, the target 64"),
    ({"with_d2t": False}, {}, "draft vocabulary of 256 tokens and no 'd2t'"),
    ({"layer_ids": None}, {}, r"has 2 layers: no hidden states of layers \[-1\]"),
    ({}, {"num_speculative_tokens": 0}, "greater than or equal to 1"),
])
def test_a_bad_eagle3_config_fails_at_start(llama_path, tmp_path, build, config, message):
    head = build_eagle3_head(tmp_path / "head", llama_path, **build)
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", speculative_config={**_eagle3(head), **config})


def _build_family_target(arch: str, folder):
    if arch == "gemma2":
        from family_models import build_family_model

        return build_family_model(folder, arch)
    from moe_models import build_moe_model

    return build_moe_model(folder, arch)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3-moe"])
def test_the_model_plugins_record_the_layers_transformers_computes(arch, llama_path, tmp_path):
    """``set_aux_hidden_state_layers`` on the engine's own model: what the forward of a prompt
    records is transformers' residual stream entering layers 0 and 1 and the norm's input."""
    path = llama_path if arch == "llama" else _build_family_target(arch, tmp_path / arch)
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    layer_ids = [num_layers, 0, 1]  # any order, as asked
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", enable_prefix_caching=False)
    runner = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner)[0]
    runner.record_aux_hidden_states(tuple(layer_ids))
    taken: list[torch.Tensor] = []
    take = runner.model.take_aux_hidden_states

    def recording():
        states = take()
        taken.append(states)
        return states

    runner.model.take_aux_hidden_states = recording
    prompt = _repetitive_prompts()[2]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1))
    expected, _ = target_layer_states(path, prompt, layer_ids)
    assert taken[0].shape == expected.shape
    torch.testing.assert_close(taken[0], expected, atol=1e-4, rtol=1e-4)


def test_sampled_eagle3_drafts_are_drawn_inside_the_draft_vocabulary(llama_path, eagle3_head):
    """A sampled request's ``q`` lives on the target tokens the head's draft vocabulary maps to
    (``d2t``), at most top-k of them, and sums to one."""
    from tokenmill_spec_eagle.checkpoint import read_head_weights

    d2t = read_head_weights(str(eagle3_head), shared_prefixes=())["d2t"].long()
    reachable = torch.zeros(384, dtype=torch.bool)
    reachable[torch.arange(len(d2t)) + d2t] = True
    llm = _engine(llama_path, {**_eagle3(eagle3_head, 2), "min_acceptance_rate": 0})
    proposer = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner.spec_decode.proposer)[0]
    handed: list[torch.Tensor] = []
    take = proposer.take_draft_probs

    def recording():
        probs = take()
        handed.extend(probs.values())
        return probs

    proposer.take_draft_probs = recording
    params = SamplingParams(temperature=0.9, top_k=20, seed=4, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _repetitive_prompts()[:4]], params)
    assert handed
    for q in handed:
        q = q.cpu()
        assert q.sum(-1) == pytest.approx(torch.ones(len(q)), abs=1e-5)
        assert not q[:, ~reachable].any() and ((q > 0).sum(-1) <= 20).all()
