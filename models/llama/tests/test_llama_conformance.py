"""The Llama-family plugin through the conformance kit: greedy tokens against transformers,
whole and with chunked prefill, on tiny configs (Llama from the kit's dimensions; Mistral's
sliding window and Qwen3's q/k norms from tests/tiny_models.py's builders)."""

from __future__ import annotations

from pathlib import Path

from tiny_models import build_model
from transformers import LlamaConfig

from tokenmill.testing.models import TINY_DIMENSIONS, ModelConformance


class TestLlamaConformance(ModelConformance):
    architecture = "LlamaForCausalLM"

    def tiny_config(self) -> LlamaConfig:
        return LlamaConfig(**TINY_DIMENSIONS)


class TestMistralConformance(ModelConformance):
    architecture = "MistralForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_model(folder, "mistral")  # a 16-token window, shorter than the longest prompt


class TestQwen3Conformance(ModelConformance):
    architecture = "Qwen3ForCausalLM"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_model(folder, "qwen3")
