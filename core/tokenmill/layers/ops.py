"""The elementwise ops inside a decoder layer, and where a platform swaps in
faster ones.

The torch implementations here (``NativeLayerOps``) are the reference: they
compute exactly what transformers computes. A platform may register its own
implementation for its device type (the CPU platform registers fused C++
kernels, float32 and bfloat16); layers ask :func:`layer_ops` for the one that
matches the tensor in hand, so two engines on different devices in one process
each get their own.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Once, after loading: a form of ``weight`` [N, K] that ``linear`` computes with
        faster (a packed layout, say), or None to use the weight as it is."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               prepared: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``prepared`` is what ``prepare_linear_weight`` returned."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, in float32."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` in place, then ``rms_norm(residual)``; ``x`` may be overwritten."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 2I] -> [..., I]``: silu of the first half times the second half."""
        ...

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GPT-NeoX rotary embedding of ``q`` [T, H, D] and ``k`` [T, H_kv, D]; may rotate in place."""
        ...

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' SiLU MLPs of tokens ``x`` [T, H]: token ``t`` goes through experts
        ``topk_ids[t]`` [k] (gate/up ``w13[e]`` [2I, H], down ``w2[e]`` [H, I]) and the
        outputs are summed weighted by ``topk_weights[t]`` (float32) -> [T, H]."""
        ...


class NativeLayerOps:
    """The torch reference, in transformers' order of operations."""

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               prepared: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """One expert at a time, over the experts that got tokens (transformers' loop): every
        kernel is tested against this."""
        out = torch.zeros_like(x)
        for expert in torch.unique(topk_ids).tolist():
            tokens, slot = torch.where(topk_ids == expert)
            hidden = self.silu_and_mul(F.linear(x[tokens], w13[expert]))
            hidden = F.linear(hidden, w2[expert]) * topk_weights[tokens, slot, None]
            out.index_add_(0, tokens, hidden.to(out.dtype))
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


NATIVE = NativeLayerOps()
_BY_DEVICE_TYPE: dict[str, LayerOps] = {}


def register_layer_ops(device_type: str, ops: LayerOps) -> None:
    """Called by a platform (once its kernels are ready) for tensors of its device type."""
    _BY_DEVICE_TYPE[device_type] = ops


def layer_ops(device: torch.device) -> LayerOps:
    return _BY_DEVICE_TYPE.get(device.type, NATIVE)
