"""The sampler against a plain per-row reference written here, independently."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tokenmill.sample import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    pad_token_ids,
)
from tokenmill.sampling_params import SamplingParams

VOCAB = 64
EOS = 3


def build(
    params: list[SamplingParams],
    *,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    eos: int | None = EOS,
    vocab: int = VOCAB,
) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.from_params(
        params,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(rows)],
        prompt_token_ids=prompts if prompts is not None else [[1, 2] for _ in range(rows)],
        generators=generators or {},
        eos_token_ids=[eos] * rows,
        vocab_size=vocab,
        device="cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded(seed)) * 3


# --- per-row references -----------------------------------------------------


def ref_penalties(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    row = list(row)
    for token in set(prompt) | set(output):
        rep = p.repetition_penalty
        row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
    for token, count in Counter(output).items():
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def ref_keep_top_k(row: torch.Tensor, k: int) -> set[int]:
    if k <= 0 or k >= row.numel():
        return set(range(row.numel()))
    kth = torch.topk(row, k).values[-1]
    return {i for i in range(row.numel()) if row[i] >= kth}


def ref_keep_top_p(row: torch.Tensor, keep: set[int], p: float) -> set[int]:
    kept = sorted(keep, key=lambda i: -row[i].item())
    weights = [math.exp(row[i].item()) for i in kept]
    total = sum(weights)
    nucleus, mass = set(), 0.0
    for token, weight in zip(kept, weights, strict=True):
        nucleus.add(token)
        mass += weight / total
        if mass >= p:
            break
    return nucleus


def ref_keep_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    probs = [math.exp(x) for x in row.tolist()]
    top = max(probs)
    return {i for i, q in enumerate(probs) if q >= min_p * top}


def kept(row: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(row.tolist()) if x != float("-inf")}


# --- tests ------------------------------------------------------------------


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = random_logits(6)
    before = logits.clone()
    meta = build([SamplingParams(temperature=0.0) for _ in range(6)])
    assert meta.all_greedy and not meta.all_random
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("extra", [{}, {"top_k": 5, "top_p": 0.8, "min_p": 0.05}, {"logit_bias": {3: 2.0}},
                                   {"min_tokens": 4}, {"repetition_penalty": 1.3}])
def test_random_sampling_leaves_the_input_untouched(extra) -> None:
    logits = random_logits(4)
    before = logits.clone()
    Sampler()(logits, build([SamplingParams(temperature=0.8, **extra) for _ in range(4)]))
    assert torch.equal(logits, before)


def test_greedy_on_half_precision_logits() -> None:
    logits = random_logits(3).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 3))
    assert out.sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()


def test_metadata_switches_off_unused_passes() -> None:
    meta = build([SamplingParams(), SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)])
    assert meta.top_p is None and meta.top_k is None and meta.min_p is None
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert meta.max_num_logprobs is None and meta.min_tokens == {}
    assert not meta.all_greedy and not meta.all_random

    meta = build(
        [SamplingParams(top_k=5, logprobs=2), SamplingParams(top_k=VOCAB + 10, repetition_penalty=1.2, logprobs=0)],
        prompts=[[1], [4, 5, 6]],
    )
    assert meta.top_k.tolist() == [5, 0]
    assert meta.max_num_logprobs == 2
    assert not meta.no_penalties
    assert meta.prompt_token_ids.tolist() == [[1, VOCAB, VOCAB], [4, 5, 6]]


def test_penalties_match_reference() -> None:
    rows = 5
    gen = seeded(1)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=1.5),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, presence_penalty=-1.0),
    ]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 0, 3, 12, 5)]
    outputs = [torch.randint(0, VOCAB // 4, (n,), generator=gen).tolist() for n in (9, 4, 0, 6, 15)]
    logits = random_logits(rows, seed=2)
    meta = build(params, prompts=prompts, outputs=outputs)

    got = apply_penalties(
        logits.clone(),
        meta.prompt_token_ids,
        pad_token_ids(outputs, VOCAB, "cpu"),
        meta.presence_penalties,
        meta.frequency_penalties,
        meta.repetition_penalties,
    )
    want = torch.tensor([ref_penalties(logits[i].tolist(), prompts[i], outputs[i], params[i]) for i in range(rows)])
    torch.testing.assert_close(got, want)

    # End to end: a greedy row picks the argmax of the penalised logits.
    greedy = [SamplingParams(temperature=0.0, **_penalty_kwargs(p)) for p in params]
    out = Sampler()(logits, build(greedy, prompts=prompts, outputs=outputs))
    assert out.sampled_token_ids.tolist() == want.argmax(-1).tolist()


def _penalty_kwargs(p: SamplingParams) -> dict[str, float]:
    return {
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
    }


def test_top_k_top_p_masks_match_reference() -> None:
    rows = 6
    logits = random_logits(rows, seed=3)
    top_k = [0, 1, 5, 20, 0, 7]
    top_p = [0.9, 1.0, 0.5, 0.3, 0.05, 1.0]
    got = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), torch.tensor(top_p))
    for i in range(rows):
        keep = ref_keep_top_p(logits[i], ref_keep_top_k(logits[i], top_k[i]), top_p[i])
        assert kept(got[i]) == keep, i
        # Kept tokens keep their logit exactly.
        idx = sorted(keep)
        assert torch.equal(got[i, idx], logits[i, idx])

    only_k = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), None)
    only_p = apply_top_k_top_p(logits.clone(), None, torch.tensor(top_p))
    for i in range(rows):
        assert kept(only_k[i]) == ref_keep_top_k(logits[i], top_k[i])
        assert kept(only_p[i]) == ref_keep_top_p(logits[i], set(range(VOCAB)), top_p[i])


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]])
    got = apply_top_k_top_p(logits.clone(), torch.tensor([3]), None)
    assert kept(got[0]) == {1, 2, 3, 4}


def test_min_p_mask_matches_reference() -> None:
    logits = random_logits(4, seed=4)
    min_p = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(logits.clone(), torch.tensor(min_p))
    for i in range(4):
        assert kept(got[i]) == ref_keep_min_p(logits[i], min_p[i])


def test_seeded_rows_reproduce_and_ignore_batch_composition() -> None:
    target = random_logits(1, vocab=1000, seed=5) * 0.1  # flat: the seed decides
    sampler = Sampler()

    def draw(seed: int, row: int, batch_size: int, other_seed: int) -> int:
        filler = random_logits(batch_size, vocab=1000, seed=other_seed)
        logits = torch.cat([filler[:row], target, filler[row + 1 :]])
        params = [SamplingParams(temperature=1.3, top_p=0.95) for _ in range(batch_size)]
        params[row] = SamplingParams(temperature=0.8, seed=seed)
        meta = build(params, generators={row: seeded(seed)}, vocab=1000)
        return sampler(logits, meta).sampled_token_ids[row].item()

    for seed in (0, 1, 2, 3):
        first = draw(seed, row=0, batch_size=1, other_seed=0)
        assert draw(seed, row=0, batch_size=1, other_seed=0) == first
        assert draw(seed, row=3, batch_size=5, other_seed=7) == first
        assert draw(seed, row=6, batch_size=8, other_seed=8) == first
    # Different seeds actually pick different tokens on a flat distribution.
    assert len({draw(s, 0, 1, 0) for s in range(8)}) > 1


def test_seeded_generator_advances_between_steps() -> None:
    logits = torch.zeros(1, 1000)
    meta_gen = seeded(11)
    meta = build([SamplingParams(seed=11)], generators={0: meta_gen}, vocab=1000)
    steps = [Sampler()(logits, meta).sampled_token_ids.item() for _ in range(4)]
    again_gen = seeded(11)
    again = build([SamplingParams(seed=11)], generators={0: again_gen}, vocab=1000)
    assert steps == [Sampler()(logits, again).sampled_token_ids.item() for _ in range(4)]
    assert len(set(steps)) > 1


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.7)],
)
def test_draws_follow_the_distribution(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(1234)
    draws = 4000
    base = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.0])
    logits = base.expand(draws, -1).clone()
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * draws
    tokens = Sampler()(logits, build(params, vocab=5, eos=None)).sampled_token_ids

    # Reference distribution, computed by hand on one row.
    scaled = (base / temperature).tolist()
    keep = ref_keep_top_p(torch.tensor(scaled), ref_keep_top_k(torch.tensor(scaled), top_k), top_p)
    weights = [math.exp(x) if i in keep else 0.0 for i, x in enumerate(scaled)]
    expected = torch.tensor(weights) / sum(weights)
    observed = torch.bincount(tokens, minlength=5).double() / draws
    # Std of a frequency is at most sqrt(0.25 / 4000) ~ 0.008; allow ~4 sigma.
    assert torch.allclose(observed, expected.double(), atol=0.03), (observed, expected)
    assert all(observed[i] == 0 for i in range(5) if i not in keep)


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    rows = 4
    logits = random_logits(rows, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, logprobs=1, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=0.0, logit_bias={7: 50.0}, logprobs=0),
    ]
    meta = build(params, outputs=[[5, 6], [], [1], []])
    out = Sampler()(logits, meta)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == (rows, 4) and lp.token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (rows, 4) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (rows,) and lp.ranks.dtype == torch.int64

    sampled = out.sampled_token_ids.tolist()
    assert sampled[3] == 7  # the bias decided, yet the logprobs stay raw
    lists = lp.tolists()
    for i in range(rows):
        ref = [x - math.log(sum(math.exp(y) for y in logits[i].tolist())) for x in logits[i].tolist()]
        order = sorted(range(VOCAB), key=lambda t: -ref[t])
        assert lists.token_ids[i][0] == sampled[i]
        assert lists.token_ids[i][1:] == order[:3]
        assert lists.logprobs[i] == pytest.approx([ref[t] for t in lists.token_ids[i]], abs=1e-5)
        assert lists.ranks[i] == order.index(sampled[i]) + 1


def test_only_sampled_logprob_when_zero_requested() -> None:
    logits = random_logits(2, seed=9)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert out.logprobs.token_ids.shape == (2, 1)
    assert out.logprobs.ranks.tolist() == [1, 1]


def test_prompt_logprobs_layout() -> None:
    logits = random_logits(5, seed=10)
    next_ids = torch.tensor([4, 0, 63, 10, 10])
    lp = compute_prompt_logprobs(logits, next_ids, 2)
    ref = torch.log_softmax(logits.double(), -1)
    assert lp.token_ids[:, 0].tolist() == next_ids.tolist()
    assert lp.token_ids[:, 1:].tolist() == ref.topk(2, -1).indices.tolist()
    torch.testing.assert_close(lp.logprobs.double(), ref.gather(1, lp.token_ids), atol=1e-5, rtol=0)
    for t in range(5):
        assert lp.ranks[t].item() == 1 + int((ref[t] > ref[t, next_ids[t]]).sum())


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 9] = 9.0
    logits[:, 8] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
    ]
    outputs = [[1], [1], [1, 2]]  # the last row has reached min_tokens
    meta = build(params, outputs=outputs)
    assert meta.min_tokens[1] == (2, {EOS, 9})
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [9, 8, EOS]

    ignore = build([SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)], outputs=[[]])
    assert ignore.min_tokens == {}


def test_min_tokens_on_random_rows_never_emit_eos() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(200, 5)
    logits[:, 2] = 5.0
    meta = build([SamplingParams(min_tokens=3)] * 200, eos=2, vocab=5)
    assert 2 not in Sampler()(logits, meta).sampled_token_ids.tolist()


def test_logit_bias_shifts_logits() -> None:
    logits = random_logits(3, seed=11)
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0, VOCAB + 5: 3.0}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, build(params)).sampled_token_ids.tolist()
    second = logits[1].clone()
    second[second.argmax()] -= 100.0
    assert out == [5, int(second.argmax()), int(logits[2].argmax())]

    meta = build(params)
    shifted = Sampler.apply_logits_processors(logits.clone(), meta)
    assert shifted[0, 5].item() == pytest.approx(logits[0, 5].item() + 100.0)
    assert torch.equal(shifted[2], logits[2])


def test_mixed_greedy_and_random_batch() -> None:
    logits = random_logits(6, seed=12)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),  # random, but only one token left
        SamplingParams(temperature=0.0, top_p=0.1, seed=3),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=1e-6),  # below the greedy threshold
        SamplingParams(temperature=0.9, min_p=1.0),  # only the top token survives
    ]
    meta = build(params, generators={2: seeded(3), 3: seeded(4)})
    assert not meta.all_greedy and not meta.all_random
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 1, 2, 4, 5)] == [argmax[i] for i in (0, 1, 2, 4, 5)]

    again = Sampler()(logits, build(params, generators={2: seeded(3), 3: seeded(4)})).sampled_token_ids.tolist()
    assert again[3] == out[3]


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, VOCAB), build([]))
    assert out.sampled_token_ids.shape == (0,)


def test_two_level_inverse_cdf_follows_a_wide_distribution() -> None:
    """Vocabulary of several chunks plus a ragged tail, zero-mass tokens on chunk edges."""
    from tokenmill.sample.ops import inverse_cdf_sample

    torch.manual_seed(7)
    vocab, draws = 1000, 40000
    weights = torch.rand(vocab) ** 4
    weights[::3] = 0.0  # a third of the vocabulary can never be drawn
    weights[255:257] = 0.0  # nor the tokens either side of the first chunk boundary
    weights[990:] = 0.5  # heavy tokens in the ragged tail
    tokens = inverse_cdf_sample(weights.expand(draws, -1).contiguous(), {})
    assert bool((weights[tokens] > 0).all())
    observed = torch.bincount(tokens, minlength=vocab).double() / draws
    expected = (weights / weights.sum()).double()
    # Grouped into 20 bands so each frequency is well estimated.
    assert torch.allclose(observed.view(20, -1).sum(1), expected.view(20, -1).sum(1), atol=0.012)


def test_inverse_cdf_finds_single_tokens_anywhere() -> None:
    from tokenmill.sample.ops import inverse_cdf_sample

    vocab = 700
    probs = torch.zeros(4, vocab)
    for row, token in enumerate([0, 255, 256, 699]):
        probs[row, token] = 3.0  # unnormalised mass is fine
    for _ in range(20):
        assert inverse_cdf_sample(probs, {}).tolist() == [0, 255, 256, 699]


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1}, {"logit_bias": {3: 50.0}}, {"min_tokens": 2},
                                   {"repetition_penalty": 1.3}, {"temperature": 0.7}])
def test_the_argmax_shortcut_gives_the_general_paths_tokens(extra, monkeypatch) -> None:
    """Greedy rows with nothing that edits the logits or reports logprobs skip the sampler's
    general path; any of those keeps it. Either way the tokens are the general path's."""
    logits = random_logits(5)
    params = {"temperature": 0.0, "stop_token_ids": [4], **extra}
    meta = build([SamplingParams(**params) for _ in range(5)], outputs=[[1, 2, 6]] * 5, prompts=[[6, 7]] * 5)
    assert meta.argmax_only == (not extra)
    general = Sampler.sample(Sampler.apply_logits_processors(logits.clone(), meta), meta)
    if meta.argmax_only:  # taken: the general path's steps are not called
        monkeypatch.setattr(Sampler, "apply_logits_processors", None)
        monkeypatch.setattr(Sampler, "sample", None)
        assert general.tolist() == logits.argmax(-1).tolist()
    out = Sampler()(logits, meta)
    if extra.get("temperature") is None:
        assert out.sampled_token_ids.tolist() == general.tolist()
    assert (out.logprobs is None) == ("logprobs" not in extra)
