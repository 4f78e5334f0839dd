"""The shortcuts that keep a decode step's fixed cost small must not change what a step does:
the decode-only input builder gives the general builder's inputs, the batch's flag counts
follow its rows, and a ``final_only`` request (``LLM.generate``'s) ends with the text, tokens
and finish reason a request that is detokenized step by step ends with."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from tokenmill import EngineConfig, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequestError
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.step_inputs import StepInputs, _decode_step_inputs, _step_inputs, build_step_inputs

BLOCK = 4
ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory": "16MiB", "dtype": "float32"}


def _state(req_id: str, rng: random.Random, **params) -> CachedRequestState:
    prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
    outputs = [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
    num_tokens = len(prompt) + len(outputs)
    blocks = rng.sample(range(1, 200), -(-num_tokens // BLOCK) + 1)
    state = CachedRequestState(req_id, prompt, SamplingParams(**params), None, blocks, num_tokens - 1)
    state.output_token_ids = outputs
    return state


def _batch(num_reqs: int, seed: int) -> InputBatch:
    rng = random.Random(seed)
    batch = InputBatch(8, 64, BLOCK)
    for i in range(num_reqs):
        batch.add(_state(f"r{i}", rng))
    return batch


def _assert_same_inputs(a: StepInputs, b: StepInputs) -> None:
    for field in dataclasses.fields(StepInputs):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "metadata":
            _assert_same_fields(x, y)
        else:
            _assert_same_value(x, y, field.name)


def _assert_same_fields(a, b) -> None:
    for field in dataclasses.fields(a):
        _assert_same_value(getattr(a, field.name), getattr(b, field.name), field.name)


def _assert_same_value(x, y, name: str) -> None:
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    else:
        assert x == y, name


@pytest.mark.parametrize("scheduled", [None, ["r4", "r1", "r2"]])
def test_the_decode_builder_gives_the_general_builders_inputs(scheduled):
    """Every row, or some rows in any order: one token each, at each row's computed length."""
    batch = _batch(6, seed=3)
    ids = scheduled or list(batch.req_ids)
    counts = dict.fromkeys(ids, 1)
    rows = np.array(sorted(batch.index_of[r] for r in ids), dtype=np.int64)
    decode = _decode_step_inputs(batch, rows, torch.device("cpu"))
    _assert_same_inputs(decode, _step_inputs(batch, rows, counts, torch.device("cpu")))
    _assert_same_inputs(build_step_inputs(batch, counts, torch.device("cpu")), decode)
    # the inputs are the step's own: a later change to the batch leaves them as they were
    before = decode.positions.clone()
    batch.num_computed_tokens[:] += 1
    assert torch.equal(decode.positions, before)


def test_a_step_with_a_longer_query_takes_the_general_builder():
    batch = _batch(3, seed=5)
    counts = {"r0": 1, "r1": 3, "r2": 1}
    batch.num_computed_tokens[1] -= 2
    inputs = build_step_inputs(batch, counts, torch.device("cpu"))
    assert inputs.metadata.num_actual_tokens == 5 and inputs.metadata.max_query_len == 3
    assert inputs.query_start.tolist() == [0, 1, 4, 5]


def test_the_flag_counts_follow_the_rows_through_adds_and_removes():
    rng = random.Random(0)
    batch = InputBatch(8, 64, BLOCK)
    kinds = [{}, {"prompt_logprobs": 2}, {"max_tokens": 0}, {}, {"prompt_logprobs": 0, "max_tokens": 0}]
    for i, params in enumerate(kinds):
        batch.add(_state(f"r{i}", rng, **params))
    pooling = _state("p", rng)
    pooling.pooling = "mean"
    batch.add(pooling)

    def assert_counts() -> None:
        live = batch.num_reqs
        assert batch.num_pooling == int(batch.is_pooling[:live].sum())
        assert batch.num_prompt_logprobs == int(batch.wants_prompt_logprobs[:live].sum())
        assert batch.num_samples_nothing == int(batch.samples_nothing[:live].sum())

    assert_counts()
    assert (batch.num_pooling, batch.num_prompt_logprobs, batch.num_samples_nothing) == (1, 2, 3)
    for req_id in ["r1", "p", "missing", "r0", "r4"]:  # rows move into the holes
        batch.remove(req_id)
        assert_counts()
    assert (batch.num_pooling, batch.num_prompt_logprobs, batch.num_samples_nothing) == (0, 0, 1)
    batch.add(_state("r1", rng, prompt_logprobs=1))  # a preempted request comes back
    assert_counts()
    assert batch.num_prompt_logprobs == 1


@pytest.fixture(scope="module")
def engine(llama_path):
    engine = LLMEngine(EngineConfig(model=str(llama_path), **ENGINE_ARGS))
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, params: list[SamplingParams], final_only: bool) -> tuple[dict, int]:
    """Finished outputs by request, and how many outputs of unfinished requests came back."""
    for i, p in enumerate(params):
        prepared = engine.prepare_request(f"{final_only}-{i}", {"prompt_token_ids": [5, 9, 12]}, p)
        engine.add_prepared(prepared, final_only=final_only)
    finals, partial = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id.split("-")[1]] = output
            else:
                partial += 1
    return finals, partial


def test_a_final_only_request_ends_as_a_streamed_one(engine):
    """Same tokens, text and finish reasons, stop strings included; but only the finished outputs."""
    streamed_text = _run(engine, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)], False)[0]
    text = streamed_text["0"].outputs[0].text
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string the text reaches midway
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, stop=[stop]),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7, n=2, logprobs=1)]
    streamed, streamed_partial = _run(engine, params, final_only=False)
    final, final_partial = _run(engine, params, final_only=True)
    assert streamed_partial > 0 and final_partial == 0
    assert streamed["1"].outputs[0].finish_reason == "stop" and streamed["1"].outputs[0].text != text
    for key in streamed:
        for a, b in zip(streamed[key].outputs, final[key].outputs, strict=True):
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                              b.stop_reason)
            assert a.logprobs == b.logprobs


def test_an_aborted_final_only_request_has_the_text_of_its_tokens(engine):
    prepared = engine.prepare_request("abort-me", {"prompt_token_ids": [5, 9, 12]},
                                      SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    engine.add_prepared(prepared, final_only=True)
    for _ in range(6):
        assert engine.step() == []
    output = engine.abort_request("abort-me")
    assert output is not None and output.finished and output.outputs[0].finish_reason == "abort"
    tokens = output.outputs[0].token_ids
    assert len(tokens) >= 5
    streamed = _run(engine, [SamplingParams(max_tokens=len(tokens), ignore_eos=True, temperature=0)], False)[0]
    assert streamed["0"].outputs[0].token_ids == tokens and streamed["0"].outputs[0].text == output.outputs[0].text
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("final_only", [False, True])
def test_a_request_without_text_gets_the_tokens_of_one_with_text(engine, monkeypatch, final_only):
    """``detokenize=False`` (bench latency's): the same tokens, finish reasons and logprobs, no
    text, and the detokenizer is never called; streamed, every step still has an output."""
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3, n=2, logprobs=1)]
    with_text, with_text_partial = _run(engine, params, final_only)
    calls = []
    original = IncrementalDetokenizer.add_tokens
    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", lambda self, ids: calls.append(ids) or original(self, ids))
    without, without_partial = _run(engine, [dataclasses.replace(p, detokenize=False) for p in params], final_only)
    assert calls == [] and without_partial == with_text_partial
    for key in with_text:
        assert with_text[key].outputs[0].text
        for a, b in zip(with_text[key].outputs, without[key].outputs, strict=True):
            assert b.text == "" and (a.token_ids, a.finish_reason, a.logprobs) == (b.token_ids, b.finish_reason,
                                                                                   b.logprobs)


def test_stop_strings_need_the_text():
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(stop=["."], detokenize=False)
    assert caught.value.param == "detokenize"
    assert SamplingParams(stop_token_ids=[2], detokenize=False).stop_token_ids == [2]  # token ids need none
