"""The Triton paged attention and KV write against the SDPA reference, on CPU tensors
through Triton's interpreter.

The interpreter has to be on (``TRITON_INTERPRET=1``) before triton is first imported
(torch imports it too), so without it in the environment one test reruns this file's
interpreted cases in a child pytest that has it; the cases are small (the interpreter
runs each tile op through numpy)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from triton_attention_cases import CASES, MIXED, Case, build_inputs, run_backend, sdpa_reference

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.fixture(scope="module")
def backend():
    from tokenmill_attn_triton.backend import TritonAttentionBackend

    return TritonAttentionBackend()


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_the_interpreted_cases_pass_under_the_interpreter():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                            "interpreted"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    # the cases, the split decodes, float16, the soft cap's effect, and two KV write cases
    expected = len(CASES) + len(SPLIT_DECODES) * 2 + 4
    assert f"{expected} passed" in child.stdout, child.stdout[-2000:]


def _assert_matches_sdpa(backend, case: Case, dtype: torch.dtype = torch.float32, tolerance: float = 2e-5) -> None:
    inputs = build_inputs(case, dtype=dtype)
    out, key_cache, value_cache = run_backend(backend, inputs)
    expected, expected_keys, expected_values = sdpa_reference(inputs)
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    # the whole caches: the new tokens' slots written, every other slot untouched
    torch.testing.assert_close(key_cache.float(), expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(value_cache.float(), expected_values, rtol=0, atol=0)


@interpreted_only
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_attention_matches_sdpa(name, backend):
    _assert_matches_sdpa(backend, CASES[name])


SPLIT_DECODES = {
    "decode": Case(((100, 1), (5, 1), (64, 1), (250, 1))),  # 5 keys over 8 splits: 7 empty shares
    "decode-window": Case(((100, 1), (300, 1), (7, 1)), sliding_window=40),
    "decode-soft-cap-gqa4": Case(((100, 1), (130, 1)), num_heads=8, num_kv_heads=2, soft_cap=5.0, query_scale=4.0),
}


@interpreted_only
@pytest.mark.parametrize("splits", [3, 8])
@pytest.mark.parametrize("name", list(SPLIT_DECODES))
def test_interpreted_split_decodes_match_sdpa(name, splits):
    from tokenmill_attn_triton.backend import TritonAttentionBackend

    _assert_matches_sdpa(TritonAttentionBackend(num_splits=splits), SPLIT_DECODES[name])


@interpreted_only
def test_interpreted_float16_matches_sdpa_in_float32(backend):
    # bfloat16 is checked on the GPU: under the interpreter tl.dot on bfloat16 inputs returns garbage
    # (numpy has no bfloat16; a 16x16 product is off by 1e10 there)
    _assert_matches_sdpa(backend, Case(MIXED), dtype=torch.float16, tolerance=2e-3)


@interpreted_only
def test_interpreted_soft_cap_changes_the_answer(backend):
    """The soft-cap case is one where capping matters, so matching it is evidence."""
    capped = build_inputs(CASES["soft-cap"])
    uncapped = build_inputs(Case(MIXED, query_scale=4.0))
    difference = (run_backend(backend, capped)[0] - run_backend(backend, uncapped)[0]).abs().max()
    assert difference > 0.1


@interpreted_only
def test_interpreted_kv_write_skips_negative_slots():
    from tokenmill_attn_triton.cache_write import write_kv_cache

    key, value = torch.randn(5, 3, 24), torch.randn(5, 3, 24)
    key_cache, value_cache = torch.zeros(4, 8, 3, 24), torch.zeros(4, 8, 3, 24)
    slots = torch.tensor([9, -1, 0, 31, -1])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    kept = slots >= 0
    expected_keys = torch.zeros(32, 3, 24).index_copy_(0, slots[kept], key[kept])
    expected_values = torch.zeros(32, 3, 24).index_copy_(0, slots[kept], value[kept])
    assert torch.equal(key_cache.view(32, 3, 24), expected_keys)
    assert torch.equal(value_cache.view(32, 3, 24), expected_values)


@interpreted_only
def test_interpreted_kv_write_reads_strided_tokens():
    """The new keys arrive as a view of the fused QKV projection: rows are strided."""
    from tokenmill_attn_triton.cache_write import write_kv_cache

    fused = torch.randn(6, 2 * 2 * 16 + 8)
    key = fused[:, 8:40].view(6, 2, 16)
    value = fused[:, 40:].view(6, 2, 16)
    key_cache, value_cache = torch.zeros(3, 16, 2, 16), torch.zeros(3, 16, 2, 16)
    slots = torch.tensor([47, 3, 4, 16, 17, 0])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(48, 2, 16)[slots], key)
    assert torch.equal(value_cache.view(48, 2, 16)[slots], value)
