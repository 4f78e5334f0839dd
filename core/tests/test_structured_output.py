"""Structured outputs below the engine: parameters, the bitmask in the sampler,
the xgrammar backend, and the scheduler's waiting-for-grammar state."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import build_tokenizer

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sample import apply_grammar_bitmask, apply_token_bitmask
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.backend import allocate_bitmask
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.xgrammar_backend import XgrammarBackend

VOCAB = 384
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, VOCAB, [EOS])


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- parameters ------------------------------------------------------------
def test_exactly_one_constraint():
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(regex="a", choice=["b"])
    assert err.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json="{not json")
    assert err.value.param == "structured_outputs.json"
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(choice=[])
    assert err.value.param == "structured_outputs.choice"


def test_sampling_params_take_a_dict_and_keys_ignore_key_order():
    params = SamplingParams(structured_outputs={"json": {"b": 1, "a": 2}})
    assert params.structured_outputs == StructuredOutputsParams(json={"b": 1, "a": 2})
    assert params.structured_outputs.key() == StructuredOutputsParams(json='{"a": 2, "b": 1}').key()
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs={"jsonn": {}})


# -- the sampler's bitmask ---------------------------------------------------
def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [70, 96, 100])  # 100: logits wider than the bitmask's 96 tokens
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]])
def test_apply_token_bitmask_matches_the_bitwise_reference(vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=gen)
    expected = _reference_mask(logits, bitmask, rows)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask, rows), expected)
    assert torch.equal(apply_token_bitmask(logits.to(torch.bfloat16), bitmask, rows).float(),
                       expected.to(torch.bfloat16).float())


def test_apply_grammar_bitmask_maps_request_ids_to_rows():
    class State:
        def __init__(self, req_id: str) -> None:
            self.req_id = req_id

    logits = torch.zeros(3, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # "b" may only sample token 5
    bitmask[1, 1] = 1 << 3  # "c" only token 35
    grammar = GrammarBitmask(bitmask, {"b": 0, "c": 1})
    apply_grammar_bitmask(logits, grammar, [State("a"), State("c"), State("b")])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [5]


# -- the xgrammar backend ------------------------------------------------------
@pytest.mark.parametrize(("params", "param"), [
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "structured_outputs.grammar"),
])
def test_invalid_constraints_name_the_field(backend, params, param):
    with pytest.raises(InvalidRequestError) as err:
        backend.validate(params)
    assert err.value.param == param and "invalid" in str(err.value) and "/project/" not in str(err.value)


def test_matcher_accepts_rolls_back_and_terminates(backend, tokenizer):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["yes", "no"])))
    ids = _text_ids(tokenizer, "yes")
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert (int(bitmask[0, EOS // 32]) >> (EOS % 32)) & 1 == 0  # EOS not allowed before a choice is complete
    assert not matcher.accept_tokens([*ids, ids[0]])  # all or nothing: the state is unchanged
    assert matcher.accept_tokens(ids) and not matcher.is_terminated()
    matcher.rollback(len(ids))
    assert matcher.accept_tokens(ids) and matcher.accept_tokens([EOS]) and matcher.is_terminated()


def test_length_bounded_strings_admit_no_control_characters(backend, tokenizer):
    # xgrammar 0.2.9 alone lets a raw tab into a maxLength string (invalid JSON); the backend must not.
    compiled = backend.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 4}))
    tab = backend.matcher(compiled)
    assert tab.accept_tokens(_text_ids(tokenizer, '"a')) and not tab.accept_tokens(_text_ids(tokenizer, "\t"))
    ok = backend.matcher(compiled)
    assert ok.accept_tokens(_text_ids(tokenizer, '"abcd"')) and not ok.accept_tokens(_text_ids(tokenizer, "e"))


# -- the scheduler ---------------------------------------------------------------
class GatedBackend(XgrammarBackend):
    """xgrammar, but compilation waits for ``gate``, and a ``fail`` regex fails to compile."""

    gate = threading.Event()

    def compile(self, params):
        self.gate.wait(10)
        if params.regex == "fail":
            raise RuntimeError("boom")
        return super().compile(params)


def _scheduler(tokenizer) -> tuple[Scheduler, StructuredOutputManager]:
    manager = StructuredOutputManager(lambda: GatedBackend(tokenizer, VOCAB, [EOS]), VOCAB)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
    return Scheduler(config, KVCacheManager(64, 4, True), manager), manager


def _request(rid: str, structured: StructuredOutputsParams | None = None) -> Request:
    params = SamplingParams(max_tokens=8, structured_outputs=structured)
    return Request(request_id=rid, prompt_token_ids=[5, 6, 7], sampling_params=params, max_tokens=8,
                   eos_token_id=EOS)


def test_a_compiling_grammar_blocks_no_one_and_gets_a_bitmask_once_ready(tokenizer):
    scheduler, manager = _scheduler(tokenizer)
    GatedBackend.gate.clear()
    try:
        scheduler.add_request(_request("c", StructuredOutputsParams(choice=["yes", "no"])))
        scheduler.add_request(_request("u"))
        assert scheduler.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
        out = scheduler.schedule()
        assert list(out.num_scheduled_tokens) == ["u"] and scheduler.grammar_bitmask(out) is None
        scheduler.update_from_output(out, ModelRunnerOutput(sampled={"u": [9]}))
    finally:
        GatedBackend.gate.set()
    manager.wait_for_any(10)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"u", "c"}
    grammar = scheduler.grammar_bitmask(out)
    assert grammar is not None and list(grammar.rows) == ["c"]
    allowed = {t for t in range(VOCAB) if (int(grammar.bitmask[0, t // 32]) >> (t % 32)) & 1}
    assert _text_ids(tokenizer, "yes")[0] in allowed and EOS not in allowed


def test_a_forbidden_token_fails_only_its_request(tokenizer):
    scheduler, manager = _scheduler(tokenizer)
    GatedBackend.gate.set()
    scheduler.add_request(_request("c", StructuredOutputsParams(choice=["yes"])))
    scheduler.add_request(_request("u"))
    manager.wait_for_any(10)
    out = scheduler.schedule()
    results = {o.req_id: o for o in scheduler.update_from_output(out, ModelRunnerOutput(sampled={"c": [EOS], "u": [9]}))}
    assert results["c"].finish_status == RequestStatus.FINISHED_ERROR and "not allowed" in results["c"].error
    assert results["c"].new_token_ids == [] and results["u"].finish_status is None


def test_a_failed_compile_and_an_abort_while_compiling_end_cleanly(tokenizer):
    scheduler, manager = _scheduler(tokenizer)
    GatedBackend.gate.clear()
    scheduler.add_request(_request("bad", StructuredOutputsParams(regex="fail")))
    scheduler.add_request(_request("gone", StructuredOutputsParams(regex="x+")))
    scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    GatedBackend.gate.set()
    manager.wait_for_any(10)
    out = scheduler.schedule()
    results = scheduler.update_from_output(out, ModelRunnerOutput())
    assert [(o.req_id, o.finish_status) for o in results] == [("bad", RequestStatus.FINISHED_ERROR)]
    assert "failed to compile" in results[0].error
    assert not scheduler.has_unfinished_requests and manager.num_pending == 0
