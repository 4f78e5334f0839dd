"""Conformance of a model plugin: greedy tokens against transformers on a tiny config.

The plugin gives a tiny config of its architecture (the kit saves a random-weight
transformers model of it, with the kit's tokenizer, as a checkpoint folder), or builds
the folder itself; the kit then checks that the architecture is registered and that
tokenmill's greedy completions in float32 are token for token those of transformers'
``generate``, in one batch and again with a step budget so small that prompts are
chunked over several steps beside other requests' decodes::

    class TestMyModel(ModelConformance):
        architecture = "MyForCausalLM"

        def tiny_config(self):
            from my_transformers_port import MyConfig
            return MyConfig(**TINY_DIMENSIONS)     # vocab_size=VOCAB_SIZE, ids as the kit's tokenizer

``TINY_DIMENSIONS`` (:mod:`tokenmill.testing.tiny_models`) are the sizes the repository's
own models use (2 layers, 64 wide, 4 heads over 2 KV heads, the kit's 384-token vocabulary). An encoder that
pools instead of generating has its own variant, :mod:`tokenmill.testing.pooling_models`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tokenmill.testing.kit_base import KitTestClass
from tokenmill.testing.tiny_models import (
    TINY_DIMENSIONS,
    VOCAB_SIZE,
    hf_greedy,
    save_random_model,
    tokenmill_greedy,
)

__all__ = ["TINY_DIMENSIONS", "VOCAB_SIZE", "ModelConformance", "kit_prompts"]

CHUNKED_STEP_BUDGET = 8  # tokens per step: every prompt longer than this is chunked


def kit_prompts(lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    """Random prompts of the given lengths over the kit's vocabulary (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


class ModelConformance(KitTestClass):
    """Base of a model plugin's conformance tests (not collected itself)."""

    architecture: ClassVar[str]
    transformers_class: ClassVar[str | None] = None  # default: the architecture's name
    prompt_lengths: ClassVar[tuple[int, ...]] = (5, 11, 23)
    max_new_tokens: ClassVar[int] = 8
    engine_options: ClassVar[dict[str, Any]] = {}

    def tiny_config(self) -> Any:
        """The plugin's tiny transformers config of :attr:`architecture`."""
        raise NotImplementedError(f"{type(self).__name__} must define tiny_config (or build_checkpoint)")

    def build_checkpoint(self, folder: Path) -> Path:
        """Write the tiny checkpoint (config, safetensors, tokenizer) into ``folder``."""
        return save_random_model(folder, self.tiny_config(), self.transformers_class or self.architecture)

    @pytest.fixture(scope="class")
    def model_checkpoint(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return self.build_checkpoint(tmp_path_factory.mktemp(self.architecture))

    @pytest.fixture(scope="class")
    def transformers_tokens(self, model_checkpoint: Path) -> list[list[int]]:
        prompts = kit_prompts(self.prompt_lengths)
        return [tokens for tokens, _ in hf_greedy(model_checkpoint, prompts, self.max_new_tokens)]

    def test_architecture_is_registered(self) -> None:
        from tokenmill.plugins import get_plugin_manager

        registered = get_plugin_manager().collect_named("tokenmill_register_models")
        assert self.architecture in registered, f"no installed plugin registers {self.architecture}"

    def test_greedy_matches_transformers(self, model_checkpoint: Path, transformers_tokens: list[list[int]]) -> None:
        ours = tokenmill_greedy(model_checkpoint, kit_prompts(self.prompt_lengths), self.max_new_tokens,
                                **self.engine_options)
        assert ours == transformers_tokens

    def test_greedy_matches_transformers_with_chunked_prefill(self, model_checkpoint: Path,
                                                             transformers_tokens: list[list[int]]) -> None:
        options = {**self.engine_options, "max_num_batched_tokens": CHUNKED_STEP_BUDGET,
                   "enable_chunked_prefill": True}
        ours = tokenmill_greedy(model_checkpoint, kit_prompts(self.prompt_lengths), self.max_new_tokens, **options)
        assert ours == transformers_tokens
