"""The attention kit fails a backend that is wrong: SDPA with one fault each (the kit's
checks called directly, as pytest would call them for a plugin's class), and the kit's
cases in a child pytest with an environment of their own (how a Triton backend runs them
under TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import pytest
import torch

from tokenmill.plugin_api import AttentionBackendSpec
from tokenmill.testing.attention import AttentionBackendConformance
from tokenmill.testing.attention_cases import DEFAULT_CASES
from tokenmill.testing.child import run_pytest_child
from tokenmill_attn_sdpa.backend import SDPABackend

CASES = {case.name: case for case in DEFAULT_CASES}


class _IgnoresTheWindow(SDPABackend):
    def forward(self, layer, query, key, value, kv_cache, metadata):
        unwindowed = type(layer)(layer.num_heads, layer.head_size, layer.num_kv_heads, layer.scale)
        return super().forward(unwindowed, query, key, value, kv_cache, metadata)


class _DropsTheLastWrite(SDPABackend):
    def forward(self, layer, query, key, value, kv_cache, metadata):
        out = super().forward(layer, query, key, value, kv_cache, metadata)
        kv_cache[1].view(-1, *kv_cache[1].shape[2:])[metadata.slot_mapping[-1]] = 0.0
        return out


class _SkipsTheLastCachedKey(SDPABackend):
    """Reads one key short of every request's sequence (an off-by-one in seq_lens)."""

    def prepare(self, metadata):
        shorter = dataclasses.replace(metadata, seq_lens=metadata.seq_lens - 1)
        return super().prepare(shorter)


def _kit_for(backend_cls: type) -> AttentionBackendConformance:
    kit = type("Kit", (AttentionBackendConformance,), {
        "backend": backend_cls, "compare_with_reference_backend": False,
        "spec": AttentionBackendSpec(name="faulty", qualname="faulty:Faulty", supports_logits_soft_cap=True)})
    return kit()


@pytest.mark.parametrize(("backend_cls", "case"), [
    (_IgnoresTheWindow, "sliding-window"),
    (_DropsTheLastWrite, "mixed"),
    (_SkipsTheLastCachedKey, "chunked-cached-prefix"),
])
def test_a_faulty_backend_fails(backend_cls, case):
    with pytest.raises(AssertionError):
        _kit_for(backend_cls).test_matches_reference(CASES[case], "float32")


def test_the_unfaulted_backend_passes_the_same_checks():
    for case in ("sliding-window", "mixed", "chunked-cached-prefix"):
        _kit_for(SDPABackend).test_matches_reference(CASES[case], "float32")


class _IgnoresTheKScale(SDPABackend):
    """Stores and reads an fp8 cache as if every k_scale were 1.0."""

    def forward(self, layer, query, key, value, kv_cache, metadata):
        unscaled = type(layer)(layer.num_heads, layer.head_size, layer.num_kv_heads, layer.scale)
        unscaled.v_scale = layer.v_scale
        return super().forward(unscaled, query, key, value, kv_cache, metadata)


class _StoresTheCacheInTheModelsRounding(SDPABackend):
    """Writes an fp8 cache by a plain cast, without dividing by the scales."""

    def forward(self, layer, query, key, value, kv_cache, metadata):
        out = super().forward(layer, query, key, value, kv_cache, metadata)
        for cache, new in zip(kv_cache, (key, value), strict=True):
            flat = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
            flat[metadata.slot_mapping] = new.to(cache.dtype).view(torch.uint8)
        return out


def _fp8_kit_for(backend_cls: type) -> AttentionBackendConformance:
    kit = type("Kit", (AttentionBackendConformance,), {
        "backend": backend_cls, "compare_with_reference_backend": False,
        "spec": AttentionBackendSpec(name="faulty", qualname="faulty:Faulty", kv_cache_dtypes=("auto", "fp8_e4m3"))})
    return kit()


@pytest.mark.parametrize("backend_cls", [_IgnoresTheKScale, _StoresTheCacheInTheModelsRounding])
def test_a_backend_that_mishandles_fp8_scales_fails(backend_cls):
    with pytest.raises(AssertionError):
        _fp8_kit_for(backend_cls).test_fp8_kv_cache(CASES["mixed"], "float32")
    _fp8_kit_for(SDPABackend).test_fp8_kv_cache(CASES["mixed"], "float32")


class TestSDPAInAChildConformance(AttentionBackendConformance):
    """Skipped here; run by the test below in a child that has the variable."""

    backend_name = "sdpa"
    dtypes = ("float32",)
    required_env: ClassVar[dict[str, str]] = {"TOKENMILL_KIT_CHILD_CHECK": "1"}


def test_kit_cases_run_in_a_child_with_their_environment():
    output = run_pytest_child(f"{__file__}::TestSDPAInAChildConformance", env={"TOKENMILL_KIT_CHILD_CHECK": "1"},
                              extra_args=["-k", "mixed or decode-only"])
    assert "4 passed" in output  # each case: test_matches_reference and test_fp8_kv_cache
    assert "TOKENMILL_KIT_CHILD_CHECK" not in os.environ  # the parent is untouched


class TestUnregisteredClassConformance(AttentionBackendConformance):
    """A backend given as a bare class with a device and dtypes, no spec (as a backend under
    development is): the kit runs every case but the soft cap."""

    backend = SDPABackend
    dtypes = ("float32",)
    compare_with_reference_backend = False
