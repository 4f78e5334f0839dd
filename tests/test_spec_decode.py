"""Speculative decoding end to end: greedy output with drafts is token-identical to decoding
without them and to transformers (float32), with chunked prefill, prefix caching and
preemption in play; a bad speculative_config fails the start; acceptance is counted."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry
from tiny_models import hf_greedy

from tokenmill import LLM, EngineConfig, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.prometheus import PrometheusStatLogger

MAX_NEW = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _repetitive_prompts(seed: int = 3) -> list[list[int]]:
    """Eight prompts of different lengths that share a prefix and repeat a phrase, so that
    prompt lookup finds drafts and the prefix cache finds hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 380) for _ in range(20)]
    prompts = []
    for length in [3, 6, 9, 14, 20, 27, 33, 41]:
        phrase = [rng.randrange(3, 380) for _ in range(max(2, length // 3))]
        prompts.append(shared + (phrase * 4)[:length] + phrase)
    return prompts


def _engine(path, speculative_config=None, **overrides) -> LLM:
    # A small token budget (chunked prefill) and a KV cache too small for all eight (preemption).
    config = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=48, num_kv_blocks=24,
                  block_size=8, enable_prefix_caching=True)
    return LLM(str(path), speculative_config=speculative_config, **{**config, **overrides})


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def _tokens_and_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [next(iter(s.values())).logprob for s in o.outputs[0].logprobs])
            for o in outputs]


def _core(llm: LLM):
    return llm.engine.core


@pytest.fixture(scope="module")
def plain_outputs(llama_path):
    llm = _engine(llama_path)
    return _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in _repetitive_prompts()], _greedy()))


def test_ngram_greedy_is_token_identical_to_no_speculation_and_transformers(llama_path, plain_outputs):
    llm = _engine(llama_path, NGRAM)
    prompts = _repetitive_prompts()
    ours = _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))
    reference = hf_greedy(llama_path, prompts, MAX_NEW)
    for i, ((tokens, logprobs), (plain_tokens, _), (hf_tokens, hf_logprobs)) in enumerate(
            zip(ours, plain_outputs, reference, strict=True)):
        assert tokens == plain_tokens, f"prompt {i}: speculation changed the greedy tokens"
        assert tokens == hf_tokens, f"prompt {i}: greedy tokens differ from transformers"
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-3), f"prompt {i}: logprobs of accepted tokens differ"
    stats = _core(llm).make_stats()
    assert stats.num_preemptions > 0, "the KV cache was meant to run out (preemption in play)"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit the prefix cache"
    assert stats.spec_decode_num_accepted_tokens > 0, "prompt lookup on repeated phrases accepted nothing"
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert _core(llm).kv_manager.num_free_blocks == _core(llm).num_kv_blocks  # every slot given back


def test_max_tokens_and_stop_token_inside_an_accepted_run(llama_path, plain_outputs):
    """A run of accepted drafts is cut where max_tokens or a stop token ends the request."""
    prompts = _repetitive_prompts()
    llm = _engine(llama_path, NGRAM)
    short = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(5))
    assert [o.outputs[0].token_ids for o in short] == [t[:5] for t, _ in plain_outputs]
    stops = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[t[6]])
             for t, _ in plain_outputs]
    stopped = llm.generate([{"prompt_token_ids": p} for p in prompts], stops)
    for out, (tokens, _) in zip(stopped, plain_outputs, strict=True):
        assert out.outputs[0].token_ids == tokens[: tokens.index(tokens[6]) + 1]
        assert out.outputs[0].finish_reason == "stop"


def test_seeded_sampling_with_speculation_is_reproducible(llama_path):
    prompts = _repetitive_prompts()[:4]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=11, max_tokens=12,
                            ignore_eos=True, logprobs=2, repetition_penalty=1.1)
    first, second = (_engine(llama_path, NGRAM).generate([{"prompt_token_ids": p} for p in prompts], params)
                     for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids) == 12


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "no-such-method", "num_speculative_tokens": 2}, "unknown speculative decoding method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "greater than or equal to 1"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 exceeds"),
])
def test_a_bad_speculative_config_fails_at_start(llama_path, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", speculative_config=config)


def test_spec_decode_counters_count(llama_path):
    registry = CollectorRegistry()
    engine = LLMEngine(EngineConfig(model=str(llama_path), max_model_len=128, kv_cache_memory="16MiB",
                                    speculative_config=NGRAM),
                       stat_loggers=[PrometheusStatLogger("tiny", registry)])
    for i, prompt in enumerate(_repetitive_prompts()[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, _greedy())
    while engine.has_unfinished_requests():
        engine.step()
    drafted = registry.get_sample_value("tokenmill:spec_decode_num_draft_tokens_total", {"model_name": "tiny"})
    accepted = registry.get_sample_value("tokenmill:spec_decode_num_accepted_tokens_total", {"model_name": "tiny"})
    assert drafted is not None and accepted is not None
    assert drafted >= accepted > 0


SEEDS = 400
# With 400 seeded samples per engine over a handful of likely tokens, two empirical
# distributions of the same law differ by a total variation of about 0.05-0.1; the bound is
# 0.2. (max_tokens 3: the first token comes from the prefill, the second is the verified one.)
# Accepting every draft (the planted bug) makes the second token a sample of the draft model
# (another random model there), far away in total variation from what the target samples.
TV_BOUND = 0.2


def _second_tokens(llm: LLM) -> list[int]:
    prompt = {"prompt_token_ids": _repetitive_prompts()[2]}
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=3, ignore_eos=True) for seed in range(SEEDS)]
    return [o.outputs[0].token_ids[1] for o in llm.generate([prompt] * SEEDS, params)]


def _total_variation(a: list[int], b: list[int]) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.count(k) / len(a) - b.count(k) / len(b)) for k in keys)


@pytest.fixture(scope="module")
def plain_second_tokens(llama_path) -> list[int]:
    return _second_tokens(_engine(llama_path, max_num_seqs=64, num_kv_blocks=None, kv_cache_memory="64MiB"))


def test_sampled_tokens_keep_their_distribution_with_a_draft_model(llama_path, plain_second_tokens):
    """The token after the first (the first one a draft can propose) has the same law with
    speculation as without, over many seeds."""
    draft = {"model": str(llama_path), "num_speculative_tokens": 1}
    llm = _engine(llama_path, draft, max_num_seqs=64, num_kv_blocks=None, kv_cache_memory="64MiB")
    assert _total_variation(_second_tokens(llm), plain_second_tokens) < TV_BOUND
    assert _core(llm).make_stats().spec_decode_num_draft_tokens >= SEEDS


def test_the_distribution_check_catches_accepting_every_draft(llama_path, model_factory, plain_second_tokens,
                                                             monkeypatch):
    """With a draft of another law (a draft sampling from the target's own distribution would
    make accepting everything exact)."""
    import tokenmill.worker.spec_decode as verify
    from tokenmill.sample.rejection_sampler import RejectionSamplerOutput

    def accept_every_draft(logits, metadata, drafts, generators, draft_probs=None):
        return RejectionSamplerOutput([[*d, 0] for d in drafts], torch.zeros(logits.shape[0], dtype=torch.int64))

    monkeypatch.setattr(verify, "rejection_sample", accept_every_draft)
    draft = {"model": str(model_factory("qwen2")), "num_speculative_tokens": 1}
    llm = _engine(llama_path, draft, max_num_seqs=64, num_kv_blocks=None, kv_cache_memory="64MiB")
    assert _total_variation(_second_tokens(llm), plain_second_tokens) > TV_BOUND


def test_constrained_requests_beside_speculating_ones(llama_path):
    """A request with a grammar decodes in the same batches as requests verifying drafts (its
    own drafts checked by its grammar); both give what they give without speculation."""
    from tokenmill import StructuredOutputsParams

    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()[:4]]
    regex = r"[a-z]{2,6}-[0-9]{2,3}"
    params = [_greedy(), SamplingParams(temperature=0, max_tokens=40,
                                        structured_outputs=StructuredOutputsParams(regex=regex)), _greedy(), _greedy()]
    plain = _engine(llama_path).generate(prompts, params)
    llm = _engine(llama_path, NGRAM)
    ours = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    assert ours[1].outputs[0].finish_reason == "stop"
    assert _core(llm).make_stats().spec_decode_num_accepted_tokens > 0


def test_a_stop_string_inside_an_accepted_run(llama_path, plain_outputs):
    """The text (and finish reason) where a stop string ends a request inside a run of accepted
    drafts is the text without speculation."""
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()]
    plain_llm = _engine(llama_path)
    tokenizer = plain_llm.get_tokenizer()
    stops = [tokenizer.decode(tokens[4:6]) for tokens, _ in plain_outputs]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=[s]) for s in stops if s]
    prompts = [p for p, s in zip(prompts, stops, strict=True) if s]
    plain = plain_llm.generate(prompts, params)
    ours = _engine(llama_path, NGRAM).generate(prompts, params)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in ours] == \
        [(o.outputs[0].text, o.outputs[0].finish_reason) for o in plain]
    assert any(o.outputs[0].finish_reason == "stop" for o in plain)


def test_constrained_requests_verify_drafts_the_grammar_allows(llama_path):
    """Requests with a grammar (and no others) take drafts too: those the grammar forbids are
    cut, each verified position is masked by the grammar, and the output is what it is without
    speculation."""
    from tokenmill import StructuredOutputsParams

    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="(ab|cd|e)+"))
    plain = _engine(llama_path).generate(prompts, params)
    llm = _engine(llama_path, NGRAM)
    ours = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    stats = _core(llm).make_stats()
    assert stats.spec_decode_num_accepted_tokens > 0, "the constrained requests verified no draft"


def test_the_workers_block_tables_follow_the_blocks_given_back(llama_path):
    """The scheduler gives back the blocks of rejected drafts; at every step the worker's block
    table of each scheduled request (its state and its batch row) is the scheduler's."""
    engine = LLMEngine(EngineConfig(model=str(llama_path), dtype="float32", max_model_len=128, block_size=4,
                                    num_kv_blocks=96, speculative_config={**NGRAM, "min_acceptance_rate": 0}))
    for i, prompt in enumerate(_repetitive_prompts()[:4]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, _greedy(24))
    core = engine.core

    def worker_tables(worker):
        runner = worker.runner
        return {rid: (list(state.block_ids),
                      runner.batch.block_table[runner.batch.index_of[rid], : runner.batch.num_blocks[
                          runner.batch.index_of[rid]]].tolist())
                for rid, state in runner.requests.items() if rid in runner.batch.index_of}

    given_back = 0
    while core.scheduler.has_unfinished_requests:
        out = core.scheduler.schedule()
        expected = {rid: core.kv_manager.get_block_ids(rid) for rid in out.num_scheduled_tokens}
        core.executor.execute_model(out, non_block=True).result()
        tables = core.executor.collective_rpc(worker_tables)[0]
        for rid, blocks in expected.items():
            assert tables[rid] == (blocks, blocks), f"{rid}: the worker's block table is not the scheduler's"
        core.scheduler.update_from_output(out, core.executor.sample_tokens(core.scheduler.grammar_bitmask(out)))
        given_back += sum(len(core.kv_manager.get_block_ids(rid)) < len(blocks)
                          for rid, blocks in expected.items() if rid in core.scheduler.requests)
    assert given_back > 0, "no running request gave blocks of rejected drafts back"
