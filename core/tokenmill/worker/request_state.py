"""What the worker remembers about a request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooling: str | None = None  # "last" / "mean" / "cls" for embedding requests
    lora_slot: int = -1  # its LoRA adapter's device slot (-1: the base model)
    mm_inputs: list[Any] = field(default_factory=list)  # its MultiModalItems, in prompt order
    mrope: tuple[Any, int] | None = None  # an M-RoPE model's prompt positions [3, P] and decode offset, once computed
    pooled_sum: torch.Tensor | None = None  # running sum of hidden states, for mean pooling; the first's, for cls
    output_token_ids: list[int] = field(default_factory=list)
    # prompt logprobs gathered so far, for a prompt computed in several chunks
    prompt_logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
