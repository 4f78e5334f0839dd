"""Recording intermediate hidden states in a decoder's forward, for EAGLE-3 speculative
decoding (``tokenmill.worker.model_interface.AuxHiddenStatesCausalLM``).

A decoder that carries its residual stream beside each layer's output (``hidden, residual``,
as the Llama, Gemma and MoE families do) calls :meth:`AuxHiddenStateRecorder.before_layer`
before each layer and :meth:`AuxHiddenStateRecorder.before_norm` before its final norm; both
return at once while no layers are asked for. Layer id ``i`` is the residual stream entering
layer ``i`` (0: the embeddings), id ``num_layers`` the last layer's output before the norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AuxHiddenStateRecorder:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layer_ids: tuple[int, ...] = ()
        self._states: dict[int, torch.Tensor] = {}
        self._recorded: torch.Tensor | None = None

    def set_layers(self, layer_ids: Sequence[int], model_name: str = "the model") -> None:
        """Record these layers from the next forward on, in this order (repeats allowed)."""
        wrong = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if wrong:
            raise ValueError(f"{model_name} has {self.num_layers} layers: no hidden states of layers {wrong} "
                             f"(ids 0..{self.num_layers})")
        self.layer_ids = tuple(int(i) for i in layer_ids)

    def before_layer(self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if self.layer_ids and index in self.layer_ids:
            self._states[index] = _stream(hidden, residual)

    def before_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """After the last layer: record it where asked, and gather the forward's states."""
        if not self.layer_ids:
            return
        if self.num_layers in self.layer_ids:
            self._states[self.num_layers] = _stream(hidden, residual)
        self._recorded = torch.cat([self._states[i] for i in self.layer_ids], dim=-1)
        self._states = {}

    def take(self) -> torch.Tensor | None:
        """The last forward's states ``[T, len(layer_ids) * hidden]``, once."""
        recorded, self._recorded = self._recorded, None
        return recorded


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    # a copy either way: the layers add into the residual (the first one's is the embedding) in place
    return hidden.clone() if residual is None else hidden + residual
