"""Draft tokens of a request with structured outputs, with the real xgrammar backend: the
scheduler cuts them at the first one the grammar forbids, the step's bitmask has a row per
verified position, and the matcher ends every check where it started (rolled back)."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer

from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.spec_tokens import grammar_valid_prefix
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.xgrammar_backend import XgrammarBackend

VOCAB = 384
EOS = 1
REGEX = "(ab|cd)+"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(bitmask, row: int) -> set[int]:
    return {t for t in range(VOCAB) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


def test_the_valid_prefix_is_counted_and_the_matcher_rolled_back(tokenizer):
    backend = XgrammarBackend(tokenizer, VOCAB, [EOS])
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex=REGEX)))
    valid, invalid = _ids(tokenizer, "abcdab"), _ids(tokenizer, "zz")
    assert grammar_valid_prefix(matcher, valid + invalid + valid) == len(valid)
    assert matcher.accept_tokens(valid), "the matcher did not end where it started"
    assert grammar_valid_prefix(matcher, invalid) == 0


def test_drafts_are_cut_by_the_grammar_and_get_a_bitmask_row_per_position(tokenizer):
    manager = StructuredOutputManager(lambda: XgrammarBackend(tokenizer, VOCAB, [EOS]), VOCAB)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                                          num_speculative_tokens=8), KVCacheManager(64, 4, True), manager)
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX))
    scheduler.add_request(Request(request_id="c", prompt_token_ids=[5, 6, 7], sampling_params=params,
                                  max_tokens=20, eos_token_id=EOS))
    manager.wait_for_any(30)
    first, *rest = _ids(tokenizer, "abcdab")
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"c": [first]},
                                                        spec_token_ids={"c": rest + _ids(tokenizer, "zz")}))
    request = scheduler.requests["c"]
    assert request.spec_token_ids == rest  # cut before the first token the grammar forbids
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"c": rest}
    grammar = scheduler.grammar_bitmask(out)
    assert grammar is not None and "c" not in grammar.rows
    rows = grammar.draft_rows["c"]
    assert len(rows) == len(rest) + 1
    for row, token in zip(rows, rest, strict=False):
        assert token in _allowed(grammar.bitmask, row)
    assert _ids(tokenizer, "zz")[0] not in _allowed(grammar.bitmask, rows[0])
    # the target accepts two drafts and samples another token the grammar allows
    last = sorted(_allowed(grammar.bitmask, rows[2]))[0]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"c": [*rest[:2], last]}))
    assert request.output_token_ids == [first, *rest[:2], last] and not request.is_finished
