"""The CPU platform's sampling kernels (C++, float32): the plain temperature draw and the greedy argmax."""

from __future__ import annotations

from types import ModuleType

import torch


class CpuSamplingKernels:
    def __init__(self, kernels: ModuleType) -> None:
        self._kernels = kernels

    def temperature_sample(self, logits: torch.Tensor, temperature: torch.Tensor,
                           uniform: torch.Tensor) -> torch.Tensor:
        return self._kernels.temperature_sample(logits, temperature, uniform)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._kernels.greedy_sample(logits)
