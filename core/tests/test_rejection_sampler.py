"""The rejection sampler on a tiny vocabulary: greedy acceptance, and the exact stochastic
rule checked by distribution (a planted accept-every-draft sampler must fail the same check)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.sample import SamplingMetadata
from tokenmill.sample.rejection_sampler import RejectionSamplerOutput, rejection_sample
from tokenmill.sampling_params import SamplingParams

VOCAB = 5
# The bound of the distribution test: with N = 10000 draws over 5 tokens the total-variation
# distance between the empirical and the true distribution has mean ~0.007 and sd ~0.003, so
# 0.03 is beyond 7 sd (seeded: the test is deterministic); the accept-everything sampler
# lands near TV(p, q) = 0.65.
N = 10000
TV_BOUND = 0.03
TARGET = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
DRAFT = torch.tensor([0.50, 0.05, 0.30, 0.05, 0.10])  # q, far from p


def _metadata(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.from_params(params=params, output_token_ids=[[] for _ in params],
                                        prompt_token_ids=[[] for _ in params], generators={},
                                        eos_token_ids=[None] * len(params), vocab_size=VOCAB, device="cpu")


def test_greedy_accepts_while_the_argmax_agrees_then_takes_the_argmax():
    logits = torch.full((7, VOCAB), -5.0)
    argmax = [1, 2, 3, 4, 0, 2, 1]
    logits[torch.arange(7), torch.tensor(argmax)] = 5.0
    params = [SamplingParams(temperature=0.0)] * 7
    # request 0: drafts [1, 2, 0] -> accepted 1, 2; rejected 0 (argmax 3) -> [1, 2, 3]
    # request 1: drafts [0, 2] against argmaxes [0, 2], bonus argmax 1 -> [0, 2, 1]
    out = rejection_sample(logits, _metadata(params), [[1, 2, 0], [0, 2]], [None, None])
    assert out.token_ids == [[1, 2, 3], [0, 2, 1]]


def _first_tokens(sampler: Callable[..., RejectionSamplerOutput], seed: int) -> torch.Tensor:
    """The first token of N requests, each with one draft drawn from q and its own seed."""
    torch.manual_seed(seed)
    drafts = torch.multinomial(DRAFT, N, replacement=True).tolist()
    logits = TARGET.log().repeat(2 * N, 1)  # two rows per request: the draft's and the bonus
    draft_probs = DRAFT.repeat(2 * N, 1)
    params = [SamplingParams(temperature=1.0)] * (2 * N)
    generators = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    out = sampler(logits, _metadata(params), [[d] for d in drafts], generators, draft_probs)
    return torch.tensor([tokens[0] for tokens in out.token_ids])


def _total_variation(tokens: torch.Tensor) -> float:
    empirical = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
    return 0.5 * float((empirical - TARGET).abs().sum())


def _accept_every_draft(logits, metadata, drafts, generators, draft_probs=None) -> RejectionSamplerOutput:
    """A planted bug: every draft accepted, as if p/q were always >= 1."""
    return RejectionSamplerOutput([[*d, 0] for d in drafts], torch.zeros(0))


def test_stochastic_rule_keeps_the_target_distribution():
    assert _total_variation(_first_tokens(rejection_sample, seed=1)) < TV_BOUND


def test_the_distribution_check_catches_a_sampler_that_accepts_every_draft():
    assert _total_variation(_first_tokens(_accept_every_draft, seed=1)) > TV_BOUND


def test_one_hot_drafts_keep_the_distribution_too():
    """A proposer without probabilities (n-gram): q is a one-hot on the draft."""
    generators = [torch.Generator().manual_seed(i) for i in range(N)]
    logits = TARGET.log().repeat(2 * N, 1)
    params = [SamplingParams(temperature=1.0)] * (2 * N)
    out = rejection_sample(logits, _metadata(params), [[1]] * N, generators)
    assert _total_variation(torch.tensor([t[0] for t in out.token_ids])) < TV_BOUND


def test_temperature_and_top_k_shape_the_target_the_drafts_are_checked_against():
    """top_k=1 at temperature 1 is greedy in effect: only the argmax can come out."""
    generators = [torch.Generator().manual_seed(i) for i in range(200)]
    logits = TARGET.log().repeat(400, 1)
    params = [SamplingParams(temperature=1.0, top_k=1)] * 400
    out = rejection_sample(logits, _metadata(params), [[0]] * 200, generators, DRAFT.repeat(400, 1))
    assert {t[0] for t in out.token_ids} == {1}


def test_a_seed_reproduces_the_verification():
    def run() -> list[list[int]]:
        generators = [torch.Generator().manual_seed(7) for _ in range(50)]
        logits = TARGET.log().repeat(150, 1)
        params = [SamplingParams(temperature=1.0)] * 150
        return rejection_sample(logits, _metadata(params), [[0, 2]] * 50, generators, DRAFT.repeat(150, 1)).token_ids

    assert run() == run()
