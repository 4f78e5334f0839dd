"""Conformance of a platform plugin: detection, memory reporting, a tiny generation.

Subclass :class:`PlatformConformance` and say which platform, and whether this machine
has its device::

    class TestMyPlatform(PlatformConformance):
        platform_name = "my-npu"

        def device_available(self) -> bool:
            import torch
            return hasattr(torch, "npu") and torch.npu.is_available()

The kit checks that the platform is detected exactly when its device is there (a
platform that is installed but finds no device steps aside), that its object keeps the
:class:`~tokenmill.plugin_api.Platform` protocol (name, device type, a device of that
type, a floating default dtype, a torch.distributed backend name), that it reports a KV
cache budget (an explicit ``kv_cache_memory`` taken as given, a positive one by
default), and, when it is the platform the engine picks here, that a tiny random Llama
generates on it in float32 the greedy tokens transformers generates on the CPU. The
cases that need the device skip without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tokenmill.plugins.specs import PlatformSpec, resolve_qualname
from tokenmill.testing.kit_base import KitTestClass
from tokenmill.testing.tiny_models import TINY_DIMENSIONS, hf_greedy, save_random_model, tokenmill_greedy

EXPLICIT_KV_BYTES = 8 << 20


def detected_platforms() -> list[PlatformSpec]:
    from tokenmill.plugins import get_plugin_manager

    return [result.value for result in get_plugin_manager().collect("tokenmill_detect_platform")]


class PlatformConformance(KitTestClass):
    """Base of a platform plugin's conformance tests (not collected itself)."""

    platform_name: ClassVar[str]
    prompt_lengths: ClassVar[tuple[int, ...]] = (5, 17)
    max_new_tokens: ClassVar[int] = 8

    def device_available(self) -> bool:
        """Whether this machine has the platform's device (the plugin's own probe)."""
        return True

    def _spec(self) -> PlatformSpec:
        found = {spec.name: spec for spec in detected_platforms()}
        if self.platform_name not in found:
            pytest.skip(f"no {self.platform_name} device here" if not self.device_available()
                        else f"the {self.platform_name} platform is not detected")
        return found[self.platform_name]

    def _platform(self) -> Any:
        return resolve_qualname(self._spec().qualname)()

    def test_detected_exactly_when_the_device_is_there(self) -> None:
        names = [spec.name for spec in detected_platforms()]
        assert (self.platform_name in names) == self.device_available(), \
            f"device available: {self.device_available()}, detected platforms: {names}"
        assert names.count(self.platform_name) <= 1

    def test_platform_object(self) -> None:
        spec, platform = self._spec(), self._platform()
        assert platform.name == spec.name == self.platform_name
        assert platform.device_type == spec.device_type
        assert platform.device().type == platform.device_type
        assert isinstance(platform.dist_backend, str) and platform.dist_backend
        dtype = platform.default_dtype()
        assert isinstance(dtype, torch.dtype) and dtype.is_floating_point

    def test_memory_reporting(self) -> None:
        from tokenmill.config import EngineConfig

        platform = self._platform()
        assert platform.kv_cache_bytes(EngineConfig.model_validate({"kv_cache_memory": EXPLICIT_KV_BYTES})) == EXPLICIT_KV_BYTES
        budget = platform.kv_cache_bytes(EngineConfig.model_validate({}))
        assert isinstance(budget, int) and budget > 0

    @pytest.fixture(scope="class")
    def tiny_llama(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from transformers import LlamaConfig

        return save_random_model(tmp_path_factory.mktemp("platform-llama"), LlamaConfig(**TINY_DIMENSIONS),
                                 "LlamaForCausalLM")

    def test_tiny_generation_matches_transformers(self, tiny_llama: Path) -> None:
        from tokenmill.testing.models import kit_prompts

        spec = self._spec()
        chosen = max(detected_platforms(), key=lambda s: s.priority)
        if chosen.name != spec.name:
            pytest.skip(f"the engine picks the {chosen.name} platform here (priority {chosen.priority})")
        prompts = kit_prompts(self.prompt_lengths)
        expected = [tokens for tokens, _ in hf_greedy(tiny_llama, prompts, self.max_new_tokens)]
        assert tokenmill_greedy(tiny_llama, prompts, self.max_new_tokens) == expected
