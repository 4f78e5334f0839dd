"""ROCm detection steps aside where torch is no HIP build or sees no device (this CPU box);
the platform itself runs where it is detected (``-m rocm``)."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenmill_platform_rocm import rocm_device_reason, tokenmill_detect_platform

from tokenmill.plugins import get_plugin_manager

ON_ROCM = torch.version.hip is not None and torch.cuda.is_available()


def test_detection_follows_torch_and_logs_when_it_steps_aside(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill_platform_rocm"):
        spec = tokenmill_detect_platform()
    assert (spec is not None) == ON_ROCM
    if not ON_ROCM:
        assert rocm_device_reason() in caplog.text and "steps aside" in caplog.text
    found = {r.value.name for r in get_plugin_manager().collect("tokenmill_detect_platform")}
    assert ("rocm" in found) == ON_ROCM and "cpu" in found


def test_rocm_reports_no_nvidia_capability_and_prefers_triton():
    from tokenmill_platform_rocm.platform import RocmPlatform

    platform = RocmPlatform(device_index=0)
    assert platform.compute_capability() is None
    assert max(platform.attention_priorities().items(), key=lambda item: item[1])[0] == "triton"


@pytest.mark.rocm
@pytest.mark.skipif(not ON_ROCM, reason="needs a ROCm GPU")
def test_engine_runs_on_rocm(tmp_path):
    from tiny_models import build_model

    from tokenmill import LLM, SamplingParams

    llm = LLM(str(build_model(tmp_path, "llama")), dtype="float32", max_model_len=64, kv_cache_memory="64MiB")
    assert llm.engine.model_info.device_type == "cuda"
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
