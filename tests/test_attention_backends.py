"""Choosing an attention backend: preference, capability and fallback."""

from __future__ import annotations

import pytest
from worker_probe import attention_backend

from tokenmill import LLM, PluginError


def _backend(llm: LLM) -> str:
    return attention_backend(llm)


def test_cpu_prefers_the_paged_kernel(llama_path):
    from tokenmill_platform_cpu.kernels import kernels_available

    llm = LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB")
    assert _backend(llm) == ("cpu-paged" if kernels_available() else "sdpa")


def test_falls_back_to_sdpa_when_the_kernel_cannot_build(llama_path, monkeypatch):
    from tokenmill_platform_cpu import attention

    monkeypatch.setattr(attention, "load_kernels", lambda: None)  # as on a machine without a compiler
    assert _backend(LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB")) == "sdpa"
    with pytest.raises(PluginError, match=r"cpu-paged.*failed to start"):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", attention_backend="cpu-paged")


def test_unknown_backend_name(llama_path):
    with pytest.raises(PluginError, match="not installed"):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", attention_backend="nope")


def test_float16_uses_a_backend_that_supports_it(llama_path):
    # the paged kernel takes float32 and bfloat16 only
    assert _backend(LLM(str(llama_path), dtype="float16", max_model_len=64, kv_cache_memory="8MiB")) == "sdpa"
