"""The CPU temperature-sampling kernel against the inverse-CDF definition, the greedy kernel
against torch's max, and the sampler's use of them."""

from __future__ import annotations

import pytest
import torch

import tokenmill.sample.kernels as kernels_module
from tokenmill import SamplingParams
from tokenmill.sample import Sampler, SamplingMetadata
from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.sampling import CpuSamplingKernels

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")


@pytest.fixture(scope="module")
def kernels() -> CpuSamplingKernels:
    return CpuSamplingKernels(load_kernels())


def _reference(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """By the definition, in float64: the first token whose cumulative mass exceeds u * total."""
    probs = torch.softmax(logits.double() / temperature.double()[:, None], dim=-1)
    cumulative = probs.cumsum(-1)
    return torch.searchsorted(cumulative, uniform.double()[:, None] * cumulative[:, -1:], right=True).squeeze(1)


def test_matches_the_definition(kernels):
    torch.manual_seed(0)
    rows, vocab = 3000, 1000  # 1000: 15 full chunks and a ragged one
    logits = torch.randn(rows, vocab) * 3
    logits[:, ::7] = float("-inf")  # masked tokens, as a grammar leaves them
    temperature = torch.rand(rows) * 1.5 + 0.1
    uniform = torch.rand(rows)
    got = kernels.temperature_sample(logits, temperature, uniform)
    assert bool(torch.isfinite(logits.gather(1, got[:, None])).all()), "a masked token was drawn"
    expected = _reference(logits, temperature, uniform)
    # Float32 sums may put a draw that lands within rounding of a boundary on its neighbour.
    assert (got != expected).float().mean() < 0.002


def test_single_token_rows_and_the_last_token(kernels):
    logits = torch.full((3, 130), float("-inf"))
    logits[0, 0] = logits[1, 63] = logits[2, 129] = 1.0
    got = kernels.temperature_sample(logits, torch.ones(3), torch.tensor([0.0, 0.5, 0.999999]))
    assert got.tolist() == [0, 63, 129]


def test_sampler_uses_the_kernel_only_on_the_plain_path(kernels, monkeypatch):
    calls = []

    greedy_calls = []

    class Spy:
        def temperature_sample(self, logits, temperature, uniform):
            calls.append(logits.shape[0])
            return kernels.temperature_sample(logits, temperature, uniform)

        def argmax(self, logits):
            greedy_calls.append(logits.shape[0])
            return kernels.argmax(logits)

    monkeypatch.setitem(kernels_module._BY_DEVICE_TYPE, "cpu", Spy())
    logits = torch.randn(4, 300)

    def draw(**params):
        meta = SamplingMetadata.from_params(
            params=[SamplingParams(**params)] * 4, output_token_ids=[[]] * 4, prompt_token_ids=[[1]] * 4,
            generators={}, eos_token_ids=[None] * 4, vocab_size=300, device=torch.device("cpu"))
        return Sampler()(logits, meta).sampled_token_ids

    draw(temperature=0.7)
    assert calls == [4]
    draw(temperature=0.7, top_k=5)
    draw(temperature=0.7, top_p=0.5)
    assert calls == [4]
    assert greedy_calls == []
    greedy = draw(temperature=0.0)
    assert calls == [4] and greedy_calls == [4] and greedy.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 32000])  # a lone token, ragged and whole vectors
def test_greedy_gives_torchs_max_index(kernels, vocab):
    """Ties (the first maximum), infinities and NaN (the first NaN: torch.max propagates it) included."""
    torch.manual_seed(0)
    logits = torch.randn(8, vocab)
    logits[1] = 0.5  # all tied
    logits[2, -1] = float("inf")
    logits[3] = float("-inf")
    logits[4, vocab // 2] = logits[4, -1] = float("nan")
    logits[5, -1] = logits[5, 0] = 9.0  # tied at both ends
    logits[6, ::3] = float("-inf")
    assert torch.equal(kernels.argmax(logits), logits.max(dim=-1).indices)
    transposed = logits.t().contiguous().t()  # the same values, not contiguous
    assert torch.equal(kernels.argmax(transposed), logits.max(dim=-1).indices)


def test_seeded_draws_reproduce(kernels, monkeypatch):
    monkeypatch.setitem(kernels_module._BY_DEVICE_TYPE, "cpu", kernels)
    logits = torch.randn(1, 5000)

    def draw(seed: int) -> int:
        meta = SamplingMetadata.from_params(
            params=[SamplingParams(temperature=1.0, seed=seed)], output_token_ids=[[]], prompt_token_ids=[[1]],
            generators={0: torch.Generator().manual_seed(seed)}, eos_token_ids=[None], vocab_size=5000,
            device=torch.device("cpu"))
        return int(Sampler()(logits, meta).sampled_token_ids[0])

    assert draw(11) == draw(11)
    assert len({draw(s) for s in range(20)}) > 5
