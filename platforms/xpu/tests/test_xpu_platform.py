"""XPU detection steps aside where torch sees no XPU (this CPU box); intel-extension-for-pytorch
is imported only when its release matches torch's (a mismatched one crashes the process)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from tokenmill_platform_xpu import tokenmill_detect_platform, xpu_device_reason
from tokenmill_platform_xpu.ipex import load_ipex, matching_ipex_version, release

from tokenmill.plugins import get_plugin_manager

ON_XPU = hasattr(torch, "xpu") and torch.xpu.is_available()


def test_detection_follows_torch_and_logs_when_it_steps_aside(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill_platform_xpu"):
        spec = tokenmill_detect_platform()
    assert (spec is not None) == ON_XPU
    if not ON_XPU:
        assert xpu_device_reason() in caplog.text and "steps aside" in caplog.text
    found = {r.value.name for r in get_plugin_manager().collect("tokenmill_detect_platform")}
    assert ("xpu" in found) == ON_XPU


def test_release_compares_major_and_minor_only():
    assert release("2.13.0+xpu") == release("2.13.1") == (2, 13)
    assert release("2.8.10+xpu") != release("2.13.0")


def test_a_mismatched_or_missing_ipex_is_never_imported():
    version = matching_ipex_version(torch.__version__)
    module = load_ipex()
    assert (module is None) == (version is None)
    if version is None:
        assert "intel_extension_for_pytorch" not in sys.modules


@pytest.mark.xpu
@pytest.mark.skipif(not ON_XPU, reason="needs an Intel XPU")
def test_engine_runs_on_xpu(tmp_path):
    from tiny_models import build_model

    from tokenmill import LLM, SamplingParams

    llm = LLM(str(build_model(tmp_path, "llama")), dtype="float32", max_model_len=64, kv_cache_memory="64MiB")
    assert llm.engine.model_info.device_type == "xpu"
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
