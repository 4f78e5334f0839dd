"""What the model runner needs from a model plugin's class (docs/plugins.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.build_context import ModelBuildContext


class CausalLMClass(Protocol):
    """A model plugin's class: built once per engine, on the target device and dtype,
    from the checkpoint's ``transformers`` config and the build context (its
    quantization config, the prefix "" of the whole model, the parallel rank)."""

    def __call__(self, hf_config: Any, *, ctx: ModelBuildContext) -> CausalLM: ...


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's flattened tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]``, called only on the positions that sample."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(checkpoint name, tensor)`` pairs, each through its parameter's
        ``weight_loader`` (``tokenmill.layers.load_weight``); returns the names of the
        parameters loaded, which must be all of them."""
        ...

    def modules(self) -> Iterator[nn.Module]: ...


class MultiModalCausalLM(CausalLM, Protocol):
    """A model that also takes images (or other items) in place of some prompt tokens.

    The runner calls ``embed_multimodal`` for the items a step's tokens overlap that the
    encoder cache lacks, then ``embed_input_ids`` for the step's embeddings, and runs the
    forward with ``inputs_embeds`` (``input_ids`` then serve only as a shape).
    """

    def embed_multimodal(self, items: list[Any]) -> list[torch.Tensor]:
        """One ``[item.length, hidden]`` tensor per :class:`~tokenmill.multimodal.MultiModalItem`,
        from the tensors its processor made (``item.data``); row ``j`` replaces the item's
        ``j``-th placeholder token."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeddings: torch.Tensor,
                        is_multimodal: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` embeddings of the step's tokens: the text embedding of each token,
        except where ``is_multimodal`` (``[T]`` bool) is set, whose rows are taken from
        ``mm_embeddings`` (``[is_multimodal.sum(), hidden]``), in order."""
        ...


class AuxHiddenStatesCausalLM(CausalLM, Protocol):
    """A model that can also hand out intermediate hidden states (EAGLE-3 drafts from three
    of the target's layers). Optional: the runner asks for them only where a proposer names
    layers (``Proposer.target_layer_ids``), and a model without these methods is then refused
    at start.

    Layer id ``i`` is the residual stream entering decoder layer ``i`` (0: the token
    embeddings), i.e. transformers' ``output_hidden_states[i]``; ``i == num_hidden_layers``
    is the last layer's output before the final norm."""

    def set_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> None:
        """From now on every forward also records the hidden states of these layers (in this
        order; repeats allowed); an id out of range, or a layout that cannot (pipeline
        stages), raises ``ValueError``."""
        ...

    def take_aux_hidden_states(self) -> torch.Tensor | None:
        """The last forward's recorded states ``[T, len(layer_ids) * hidden]``, concatenated
        in the requested order, and forget them (None: nothing recorded since)."""
        ...


def records_aux_hidden_states(model: Any) -> bool:
    """Whether ``model`` implements :class:`AuxHiddenStatesCausalLM`."""
    return (callable(getattr(model, "set_aux_hidden_state_layers", None))
            and callable(getattr(model, "take_aux_hidden_states", None)))


class MRopeCausalLM(MultiModalCausalLM, Protocol):
    """A multimodal model whose rotary positions have three sections (M-RoPE, Qwen2-VL):
    the runner gives its forward ``positions`` ``[3, T]`` in a step with item tokens, and
    ``[T]`` (the three equal) otherwise (:class:`tokenmill.layers.MRotaryEmbedding`)."""

    def mrope_prompt_positions(self, prompt_token_ids: list[int], items: list[Any]) -> tuple[np.ndarray, int]:
        """The prompt's positions ``[3, len(prompt_token_ids)]`` and the offset ``delta`` that
        the tokens after it add to their index (in all three sections)."""
        ...


def uses_mrope(model: Any) -> bool:
    """Whether ``model`` implements :class:`MRopeCausalLM`."""
    return is_multimodal(model) and callable(getattr(model, "mrope_prompt_positions", None))


def is_multimodal(model: Any) -> bool:
    """Whether ``model`` implements :class:`MultiModalCausalLM`."""
    return callable(getattr(model, "embed_multimodal", None)) and callable(getattr(model, "embed_input_ids", None))
