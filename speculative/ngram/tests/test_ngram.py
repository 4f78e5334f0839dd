"""Prompt lookup: the longest matching suffix first, its latest earlier occurrence, and the
tokens that followed it."""

from __future__ import annotations

import numpy as np

from tokenmill.plugin_api import DraftRequest, ProposerContext, SpeculativeConfig
from tokenmill_spec_ngram.proposer import NgramProposer, lookup_drafts


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # suffix [1, 2, 3] occurred at 0 (followed by 4, 5); [3] alone also occurs at 7 (followed by 9)
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 3, 9, 1, 2, 3])
    assert lookup_drafts(tokens, 1, 3, 2).tolist() == [4, 5]


def test_the_latest_earlier_occurrence_is_used():
    tokens = np.array([5, 6, 1, 5, 6, 2, 5, 6])
    assert lookup_drafts(tokens, 2, 2, 3).tolist() == [2, 5, 6]


def test_no_match_shorter_than_min_and_a_recent_match_repeats_periodically():
    tokens = np.array([1, 2, 3, 4, 2, 3])
    assert lookup_drafts(tokens, 3, 3, 2).tolist() == []  # [4, 2, 3] never occurred before
    assert lookup_drafts(tokens, 2, 2, 5).tolist() == [4, 2, 3, 4, 2]  # [4, 2, 3] follows [2, 3], and repeats
    assert lookup_drafts(np.array([5, 7, 7, 7]), 2, 2, 3).tolist() == [7, 7, 7]  # a loop drafts k tokens


def test_the_proposer_reads_its_options_from_the_config():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    proposer = NgramProposer(config, ProposerContext(vocab_size=10, max_model_len=32, device="cpu", dtype=None))
    requests = [DraftRequest("a", np.array([7, 8, 9, 7, 8]), 2), DraftRequest("b", np.array([1, 2, 3]), 2)]
    assert proposer.propose(requests) == [[9, 7], []]
