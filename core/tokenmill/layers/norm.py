"""RMSNorm, computed in float32 exactly as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.ops import layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops(x.device).rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The pre-norm residual step: ``residual += x`` (in place), returns the norm of
        the sum. ``x`` is consumed (a fused implementation writes the result into it)."""
        return layer_ops(x.device).add_rms_norm(x, residual, self.weight, self.eps)
