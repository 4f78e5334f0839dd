"""Sampling steps a platform may replace with its own kernels, by device type.

The plain random draw (temperature, no top-k / top-p / min-p) has one: it is
most of a sampling step at large vocabularies, and a kernel can do it in one pass
over each row where torch makes several over the whole batch. So has the greedy
argmax: torch's CPU max-with-index is a scalar loop (55 us for one 32,000-token
row, more than the rest of a tiny model's sampling step), a vector kernel's two
passes 3-4 us. The torch path in ``tokenmill.sample.ops`` stays the reference and
the fallback.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SamplingKernels(Protocol):
    def temperature_sample(self, logits: torch.Tensor, temperature: torch.Tensor,
                           uniform: torch.Tensor) -> torch.Tensor:
        """Per row of float32 ``logits`` ``[B, V]``: the first token whose cumulative
        probability under ``softmax(logits / temperature)`` exceeds ``uniform`` (in [0, 1)),
        never a zero-probability token. ``temperature`` > 0. Returns int64 ``[B]``."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Per row of float32 ``logits`` ``[B, V]``: the index ``logits.max(dim=-1).indices``
        gives (the first maximum; a row holding NaN: its first NaN). Returns int64 ``[B]``."""
        ...


_BY_DEVICE_TYPE: dict[str, SamplingKernels] = {}


def register_sampling_kernels(device_type: str, kernels: SamplingKernels) -> None:
    """Called by a platform (once its kernels are ready) for logits on its device type."""
    _BY_DEVICE_TYPE[device_type] = kernels


def sampling_kernels(device: torch.device) -> SamplingKernels | None:
    return _BY_DEVICE_TYPE.get(device.type)
