"""What every vision-language model here shares: its text half is a registered language model
at ``self.language_model``, which embeds the step's text tokens, runs the forward on the merged
embeddings and computes the logits. A model adds its encoder (``embed_multimodal``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.plugin_api import AttentionMetadata


class VisionLanguageModel(nn.Module):
    """A subclass builds ``self.language_model`` and its encoder; one whose language model scales
    its token embeddings overrides :meth:`embed_text_tokens`."""

    language_model: Any

    def embed_text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text tokens' embeddings as the language model's first layer takes them."""
        return self.language_model.model.embed_tokens(input_ids)

    # -- the multimodal model interface (tokenmill.worker.model_interface.MultiModalCausalLM) --
    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeddings: torch.Tensor,
                        is_multimodal: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_text_tokens(input_ids.masked_fill(is_multimodal, 0))  # a placeholder id may lie past the vocab
        embeds[is_multimodal] = mm_embeddings.to(embeds.dtype)
        return embeds

    # -- the causal-LM interface -----------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, metadata, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
