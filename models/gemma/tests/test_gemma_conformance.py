"""The Gemma plugin through the conformance kit, on tests/family_models.py's tiny Gemma 2
(soft-capped scores and logits) and Gemma 3 (sliding and global layers)."""

from __future__ import annotations

from pathlib import Path

from family_models import build_family_model

from tokenmill.testing.models import ModelConformance


class TestGemma2Conformance(ModelConformance):
    architecture = "Gemma2ForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_family_model(folder, "gemma2")


class TestGemma3Conformance(ModelConformance):
    architecture = "Gemma3ForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_family_model(folder, "gemma3")
