"""How a W8A8 layer turns its input into int8: the checkpoint's activation scheme.

compressed-tensors' ``input_activations`` say how the model was quantized, and the
layer must round its inputs the same way:

- dynamic per token (``strategy: "token"``, ``dynamic: true``): a scale per row,
  computed at run time; symmetric (``max|x| / 127``, values in [-127, 127], the
  method's original path) or asymmetric (``symmetric: false``: the row's range
  ``[min(x, 0), max(x, 0)]`` over the 256 levels, with a zero point per row);
- static per tensor (``strategy: "tensor"``, ``dynamic: false``): the checkpoint's
  ``input_scale`` (and, asymmetric, ``input_zero_point``), one per layer, calibrated
  when the model was quantized; inputs beyond the calibrated range saturate.

An asymmetric ``x`` is ``scale * (q - zero)``, so ``x @ W.T`` is ``scale * (q @ W.T -
zero * rowsum(W))``: the int8 product stays one ``torch._int_mm`` call, corrected by
the weight's row sums (kept at load). The rounding, range and zero point follow
compressed-tensors' own ``calculate_qparams`` / ``fake_quantize`` (``round(x / scale +
zero)`` clamped to [-128, 127]), which the tests check the layer against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill_quant_int8.kernels import quantize_per_token

INT8_MIN, INT8_MAX = -128, 127
LEVELS = INT8_MAX - INT8_MIN  # 255 steps between the ends of an asymmetric range
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


@dataclass(frozen=True)
class ActivationScheme:
    """``static``: per-tensor scales from the checkpoint (else per token at run time);
    ``symmetric``: no zero point."""

    symmetric: bool = True
    static: bool = False

    def describe(self) -> str:
        return f"{'static per-tensor' if self.static else 'dynamic per-token'} " \
               f"{'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class QuantizedInput:
    """``x ~ scale * (q - zero)``; ``zero`` None for a symmetric scheme."""

    q: torch.Tensor  # int8 [M, K]
    scale: torch.Tensor  # float32 [M, 1] or [1, 1]
    zero: torch.Tensor | None  # int32 [M, 1] or [1, 1]


def activation_scheme(field: str, args: dict[str, Any]) -> ActivationScheme:
    """The scheme of compressed-tensors ``input_activations`` ``args``; a ``ValueError`` naming
    the field (``field`` prefixes it: the config group) for anything this method cannot run."""
    for key, expected in (("num_bits", 8), ("type", "int")):
        if args.get(key) != expected:
            raise ValueError(f"{field}.{key} is {args.get(key)!r}; the int8 W8A8 method takes {expected!r}")
    if args.get("group_size") is not None:
        raise ValueError(f"{field}.group_size {args['group_size']}: grouped int8 activations are not this method")
    symmetric = args.get("symmetric", True)
    if symmetric not in (True, False):
        raise ValueError(f"{field}.symmetric is {symmetric!r}; expected true or false")
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if (strategy, dynamic) == ("token", True):
        return ActivationScheme(symmetric=symmetric, static=False)
    if (strategy, dynamic) == ("tensor", False):
        return ActivationScheme(symmetric=symmetric, static=True)
    raise ValueError(f"{field} are strategy {strategy!r} with dynamic {dynamic!r}; the int8 W8A8 method takes "
                     "dynamic per token (strategy 'token', dynamic true) or static per tensor (strategy "
                     "'tensor', dynamic false, an input_scale per layer)")


def quantize_input(x: torch.Tensor, scheme: ActivationScheme, input_scale: torch.Tensor | None = None,
                   input_zero: torch.Tensor | None = None) -> QuantizedInput:
    """A 2-d ``x`` in int8 under ``scheme``; a static one's ``input_scale`` (and ``input_zero``) are the layer's."""
    if scheme.static:
        if input_scale is None:
            raise ValueError("a static activation scheme needs the layer's input_scale")
        scale = input_scale.reshape(1, 1).float()
        zero = None if scheme.symmetric else _zero_of(input_zero).reshape(1, 1)
        return QuantizedInput(_round(x, scale, zero), scale, zero)
    if scheme.symmetric:
        q, scale = quantize_per_token(x)
        return QuantizedInput(q, scale, None)
    return quantize_per_token_asymmetric(x)


def quantize_per_token_asymmetric(x: torch.Tensor) -> QuantizedInput:
    """Each row's range ``[min(x, 0), max(x, 0)]`` over the 256 int8 levels (zero stays exact)."""
    low = x.amin(dim=-1, keepdim=True).float().clamp(max=0)
    high = x.amax(dim=-1, keepdim=True).float().clamp(min=0)
    scale = ((high - low) / LEVELS).clamp(min=_MIN_SCALE)
    zero = torch.round(INT8_MIN - low / scale).clamp(INT8_MIN, INT8_MAX).to(torch.int32)
    return QuantizedInput(_round(x, scale, zero), scale, zero)


def _round(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``round(x / scale + zero)`` saturated to int8's [-128, 127]."""
    scaled = x.float() / scale
    if zero is not None:
        scaled = scaled + zero.float()
    return torch.round(scaled).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def _zero_of(input_zero: torch.Tensor | None) -> torch.Tensor:
    if input_zero is None:
        raise ValueError("an asymmetric static activation scheme needs the layer's input_zero_point")
    return input_zero.to(torch.int32)


def merge_static_shards(scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One per-tensor ``(scale, zero)`` for a merged layer (q/k/v, gate/up) from its shards' ones.

    The shards read the same input, so a calibrated checkpoint gives them equal
    parameters, kept as they are. Where they differ, the merged layer takes the
    smallest range covering every shard's (the largest scale, symmetric; the union of
    ``[(-128 - zero) * scale, (127 - zero) * scale]``, asymmetric): no input a shard
    would represent saturates, at the cost of a coarser step for the others.
    """
    scales = scales.float()
    if zeros is None:
        return scales.max().reshape(1), None
    if bool((scales == scales[0]).all()) and bool((zeros == zeros[0]).all()):
        return scales[:1], zeros[:1]
    low = ((INT8_MIN - zeros.float()) * scales).min().clamp(max=0)
    high = ((INT8_MAX - zeros.float()) * scales).max().clamp(min=0)
    scale = ((high - low) / LEVELS).clamp(min=_MIN_SCALE)
    zero = torch.round(INT8_MIN - low / scale).clamp(INT8_MIN, INT8_MAX).to(zeros.dtype)
    return scale.reshape(1), zero.reshape(1)
