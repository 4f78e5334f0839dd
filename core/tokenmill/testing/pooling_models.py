"""Conformance of a pooling (embedding) model plugin: embeddings against transformers.

The variant of :mod:`tokenmill.testing.models` for an encoder that pools instead of
generating (BERT and its kin): the plugin builds a tiny checkpoint folder (config,
safetensors, its tokenizer); the kit checks that the architecture is registered and
that ``LLM.embed`` with each pooling in :attr:`PoolingModelConformance.poolings` gives,
in float32, the pooled final hidden states of transformers' ``AutoModel`` on the same
texts in one padded batch (``cls``: the first token's, ``mean``: the masked mean,
``last``: the last real token's)::

    class TestMyEncoder(PoolingModelConformance):
        architecture = "MyEncoderModel"

        def build_checkpoint(self, folder):
            return save_my_tiny_encoder(folder)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tokenmill.testing.kit_base import KitTestClass

KIT_TEXTS = (
    "the cat sleeps on the mat",
    "a dog runs in the park today",
    "paris is the capital of france",
    "who plays music",
)
EMBEDDING_ATOL, EMBEDDING_RTOL = 1e-5, 1e-4


def transformers_pooled(folder: Path, texts: list[str], pooling: str) -> torch.Tensor:
    """The pooled final hidden states transformers computes for ``texts`` (one padded batch)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return hidden[torch.arange(len(texts)), mask.sum(1) - 1]


class PoolingModelConformance(KitTestClass):
    """Base of a pooling model plugin's conformance tests (not collected itself)."""

    architecture: ClassVar[str]
    poolings: ClassVar[tuple[str, ...]] = ("cls", "mean", "last")
    texts: ClassVar[tuple[str, ...]] = KIT_TEXTS

    def build_checkpoint(self, folder: Path) -> Path:
        """Write the tiny checkpoint (config, safetensors, tokenizer) into ``folder``."""
        raise NotImplementedError(f"{type(self).__name__} must define build_checkpoint")

    @classmethod
    def tokenmill_kit_parameters(cls, full: bool) -> list[tuple[str, list[Any], list[str]]]:
        return [("pooling", list(cls.poolings), list(cls.poolings))]

    @pytest.fixture(scope="class")
    def model_checkpoint(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return self.build_checkpoint(tmp_path_factory.mktemp(self.architecture))

    @pytest.fixture(scope="class")
    def engine(self, model_checkpoint: Path) -> Any:
        from tokenmill import LLM

        return LLM(str(model_checkpoint), dtype="float32", max_model_len=64)

    def test_architecture_is_registered(self) -> None:
        from tokenmill.plugins import get_plugin_manager

        registered = get_plugin_manager().collect_named("tokenmill_register_models")
        assert self.architecture in registered, f"no installed plugin registers {self.architecture}"

    def test_embeddings_match_transformers(self, engine: Any, model_checkpoint: Path, pooling: str) -> None:
        outputs = engine.embed(list(self.texts), pooling=pooling)
        ours = torch.tensor([out.outputs.embedding for out in outputs])
        expected = transformers_pooled(model_checkpoint, list(self.texts), pooling)
        torch.testing.assert_close(ours, expected, atol=EMBEDDING_ATOL, rtol=EMBEDDING_RTOL)
