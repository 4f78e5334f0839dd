"""The mixture-of-experts plugin through the conformance kit, on tests/moe_models.py's tiny
Mixtral and Qwen3-MoE (routers widened so the top-2 choice is not a rounding tie)."""

from __future__ import annotations

from pathlib import Path

from moe_models import build_moe_model

from tokenmill.testing.models import ModelConformance


class TestMixtralConformance(ModelConformance):
    architecture = "MixtralForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_moe_model(folder, "mixtral")


class TestQwen3MoeConformance(ModelConformance):
    architecture = "Qwen3MoeForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_moe_model(folder, "qwen3-moe")
