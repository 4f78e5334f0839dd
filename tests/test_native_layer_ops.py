"""The engine on the torch reference layer ops (what platforms without kernels of their
own run, CUDA included) against transformers. Elsewhere on the CPU the platform's fused
kernels run; here they are swapped out after start-up."""

from __future__ import annotations

import pytest
from test_golden import _assert_matches, _greedy, _prompts, reference  # noqa: F401  (fixture)

import tokenmill.layers.ops as layer_ops_module
from tokenmill import LLM
from tokenmill.layers import NativeLayerOps


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_reference_layer_ops_match_transformers(arch, model_factory, reference, monkeypatch):  # noqa: F811
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB")
    monkeypatch.setitem(layer_ops_module._BY_DEVICE_TYPE, "cpu", NativeLayerOps())
    assert type(layer_ops_module.layer_ops(llm.engine.core.platform.device())) is NativeLayerOps
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    _assert_matches(outputs, reference(arch, (1,)))
