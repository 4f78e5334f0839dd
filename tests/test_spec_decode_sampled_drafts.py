"""Sampled drafts: the draft_model proposer draws each draft from the draft's own distribution
``q`` at the request's temperature and truncation, and the rejection sampler, told ``q``,
keeps the output exactly the target's law.

Checked against transformers: the proposer's ``q`` is the draft's softmax at the request's
temperature and top-k, and the first two generated tokens (the second is the first one a
draft proposes) follow the target's own sampling distribution computed from transformers'
logits, and so does the third given the commonest first two (the second draft's position),
over thousands of seeded requests of one batched ``generate``. The draft is the tiny
target with noise on its weights: a draft that agrees with the target about 60% of the time,
so that both accepted and rejected drafts are common."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_spec_decode import _engine

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.spec_decode.proposer import DraftRequest

PROMPT = [5, 17, 42, 99, 7]
TEMPERATURE, TOP_K = 1.0, 8
NUM_SAMPLES = 3000
# Chi-square quantile for a 1e-4 false-alarm chance (Wilson-Hilferty: z = 3.719 is the normal's
# 1 - 1e-4 quantile). The seeds are fixed, so the test is deterministic; a correct sampler
# would fail it for 1 in 10^4 choices of seeds (measured: 34 against a bound of 81). The planted
# bugs land far above it (accepting every draft moves about 0.4 of the second token's mass,
# the total variation between the draft's q and the target's p here).
Z_FALSE_ALARM = 3.719


@pytest.fixture(scope="module")
def noisy_draft(llama_path, tmp_path_factory) -> Path:
    """The tiny target with Gaussian noise (0.1 of each tensor's spread) on every weight."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("noisy-draft")
    shutil.copytree(llama_path, folder, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.1 * weight.std())
    model.save_pretrained(folder)
    return folder


def _hf_probs(path: Path, token_ids: list[int]) -> torch.Tensor:
    """``[V]``: the distribution the ordinary sampler draws the next token from at TEMPERATURE
    and TOP_K, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, -1]
    top = logits.topk(TOP_K)
    probs = torch.zeros_like(logits)
    probs[top.indices] = torch.softmax(top.values / TEMPERATURE, dim=-1)
    return probs


def _joint_law(path: Path) -> dict[tuple[int, int], float]:
    """P(first, second token) under the target itself."""
    first = _hf_probs(path, PROMPT)
    law = {}
    for t1 in first.nonzero().flatten().tolist():
        second = _hf_probs(path, [*PROMPT, t1])
        for t2 in second.nonzero().flatten().tolist():
            law[(t1, t2)] = float(first[t1] * second[t2])
    return law


def _chi_square(counts: Counter, law: dict, n: int) -> tuple[float, float]:
    """The statistic over the cells expected 5+ times (the rest pooled into one), and the
    1e-4 false-alarm bound for its degrees of freedom."""
    big = {cell: p for cell, p in law.items() if p * n >= 5}
    observed = [counts.get(cell, 0) for cell in big] + [n - sum(counts.get(cell, 0) for cell in big)]
    expected = [p * n for p in big.values()] + [n * (1 - sum(big.values()))]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    df = sum(1 for e in expected if e > 0) - 1
    bound = df * (1 - 2 / (9 * df) + Z_FALSE_ALARM * math.sqrt(2 / (9 * df))) ** 3
    return statistic, bound


def _first_three_tokens(llm) -> list[tuple[int, ...]]:
    """Four tokens per request: the first is sampled after the prompt, then two drafts are
    verified at once (the scheduler drafts no further than ``max_tokens - 1``)."""
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed, max_tokens=4, ignore_eos=True)
              for seed in range(NUM_SAMPLES)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params)
    return [tuple(o.outputs[0].token_ids[:3]) for o in outputs]


def _first_two_statistic(tokens: list[tuple[int, ...]], path: Path) -> tuple[float, float]:
    return _chi_square(Counter(t[:2] for t in tokens), _joint_law(path), len(tokens))


def _speculating(llama_path, noisy_draft):
    return _engine(llama_path, {"model": str(noisy_draft), "num_speculative_tokens": 2}, max_num_seqs=256,
                   num_kv_blocks=None, kv_cache_memory="64MiB", max_num_batched_tokens=512)


def test_sampled_drafts_keep_the_targets_distribution(llama_path, noisy_draft):
    llm = _speculating(llama_path, noisy_draft)
    tokens = _first_three_tokens(llm)
    statistic, bound = _first_two_statistic(tokens, llama_path)
    assert statistic < bound, f"first two tokens: chi-square {statistic:.1f} over the bound {bound:.1f}"
    prefix, _ = Counter(t[:2] for t in tokens).most_common(1)[0]
    thirds = Counter(t[2] for t in tokens if t[:2] == prefix)
    law = {t: float(p) for t, p in enumerate(_hf_probs(llama_path, [*PROMPT, *prefix])) if p > 0}
    statistic, bound = _chi_square(thirds, law, sum(thirds.values()))
    assert statistic < bound, f"third token after {prefix}: chi-square {statistic:.1f} over the bound {bound:.1f}"
    stats = llm.engine.core.make_stats()
    # both paths of the rule ran: some drafts accepted, some rejected
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def _accept_every_draft(logits, metadata, drafts, generators, draft_probs=None):
    from tokenmill.sample.rejection_sampler import RejectionSamplerOutput

    return RejectionSamplerOutput([[*d, 0] for d in drafts], torch.zeros(logits.shape[0], dtype=torch.int64))


def _a_sharper_q(logits, metadata, drafts, generators, draft_probs=None):
    """Verify with ``q**2`` renormalised instead of the ``q`` the drafts came from."""
    from tokenmill.sample.rejection_sampler import rejection_sample

    if draft_probs is not None:
        draft_probs = draft_probs**2 / (draft_probs**2).sum(-1, keepdim=True).clamp(min=1e-30)
    return rejection_sample(logits, metadata, drafts, generators, draft_probs)


@pytest.mark.parametrize("bug", [_accept_every_draft, _a_sharper_q])
def test_the_check_catches_a_planted_bug(llama_path, noisy_draft, monkeypatch, bug):
    """Accepting every draft gives a chi-square near 7700 here, verifying with a wrong ``q``
    near 900 (the bound is 81). Dropping ``q`` (every draft taken as one-hot) is no bug: that
    rule is exact whatever the drafts' law, only it accepts fewer."""
    import tokenmill.worker.spec_decode as verify

    monkeypatch.setattr(verify, "rejection_sample", bug)
    statistic, bound = _first_two_statistic(_first_three_tokens(_speculating(llama_path, noisy_draft)), llama_path)
    assert statistic > bound


def test_a_proposals_q_is_the_drafts_softmax_at_the_request_temperature(llama_path, noisy_draft):
    llm = _speculating(llama_path, noisy_draft)
    proposer = llm.engine.core.executor.collective_rpc(lambda worker: worker.runner.spec_decode.proposer)[0]
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=3)
    greedy = SamplingParams(temperature=0.0)
    # a grammar cuts drafts by their values, exact only for one-hot drafts: argmax too
    constrained = SamplingParams(temperature=TEMPERATURE, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    requests = [DraftRequest("sampled", np.array(PROMPT), 2, params), DraftRequest("greedy", np.array(PROMPT), 2, greedy),
                DraftRequest("constrained", np.array(PROMPT), 2, constrained)]
    drafts = proposer.propose(requests)
    probs = proposer.take_draft_probs()
    assert set(probs) == {"sampled"}  # greedy drafts are one-hot: no q handed over
    sampled = drafts[0]
    assert len(sampled) == 2 and probs["sampled"].shape == (2, 384)
    for j in range(2):
        expected = _hf_probs(noisy_draft, [*PROMPT, *sampled[:j]])
        assert probs["sampled"][j].cpu() == pytest.approx(expected, abs=1e-5)
        assert expected[sampled[j]] > 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(noisy_draft, dtype=torch.float32)
    with torch.no_grad():
        first = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
        second = int(model(torch.tensor([[*PROMPT, first]])).logits[0, -1].argmax())
    assert drafts[1] == drafts[2] == [first, second]


def test_a_mixed_batch_keeps_greedy_output_and_reproduces_seeded_samples(llama_path, noisy_draft):
    """Greedy and seeded sampled requests in one batch: the greedy ones decode exactly as
    without speculation; the sampled ones come out the same in a second engine."""
    from test_spec_decode import _greedy, _repetitive_prompts

    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts()]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    params = [_greedy(12) if i % 2 else sampled for i in range(len(prompts))]
    plain = _engine(llama_path).generate(prompts, _greedy(12))
    first, second = (_speculating(llama_path, noisy_draft).generate(prompts, params) for _ in range(2))
    for i, (a, b, p) in enumerate(zip(first, second, plain, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}: not reproducible"
        if i % 2:
            assert a.outputs[0].token_ids == p.outputs[0].token_ids, f"prompt {i}: greedy output changed"
