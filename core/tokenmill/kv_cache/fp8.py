"""FP8 KV cache: which torch dtype a ``kv_cache_dtype`` name means, and the torch
reference of storing K/V in it.

A cache in float8 takes one byte per element: half of bfloat16's, a quarter of
float32's, so the same KV budget holds two to four times the blocks. Each attention
layer carries a per-tensor scale for its keys and one for its values
(``Attention.k_scale`` / ``v_scale``, from the checkpoint where it has them, else
1.0): a value is stored as ``x / scale`` rounded to float8 (saturated at the
format's largest finite value, never inf/NaN) and read back as ``stored * scale``
in the model's dtype. Backends that store fp8 KV use these functions (or a kernel
tested against them).

The writes go through a ``uint8`` view of the cache: torch's CPU ``index_copy_``
has no float8 kernel, and a byte copy is exact.
"""

from __future__ import annotations

import torch

# The engine option's values; "fp8" means e4m3 (more mantissa, the usual choice for KV).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
KV_CACHE_DTYPE_NAMES = ("auto", *FP8_KV_CACHE_DTYPES)


def normalize_kv_cache_dtype(name: str) -> str:
    """``"fp8"`` -> ``"fp8_e4m3"``; an unknown name is a ``ValueError`` listing the known ones."""
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}: use auto, fp8, {', '.join(FP8_KV_CACHE_DTYPES)}")
    return name


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV tensors are allocated in: the model's for ``"auto"``."""
    name = normalize_kv_cache_dtype(name)
    return model_dtype if name == "auto" else FP8_KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_CACHE_DTYPES.values()


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in the float8 ``dtype``, saturated at its largest finite value."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Float8 ``stored`` back in ``dtype``: ``stored * scale``."""
    return (stored.float() * scale).to(dtype) if scale != 1.0 else stored.to(dtype)


def write_kv(flat_cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """``flat_cache[slots] = values`` (``flat_cache`` ``[slots, heads, head_size]``), quantised
    with ``scale`` when the cache is float8."""
    if not is_fp8(flat_cache.dtype):
        flat_cache.index_copy_(0, slots, values)
        return
    stored = quantize_kv(values, scale, flat_cache.dtype)
    flat_cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))


def gather_blocks(cache: torch.Tensor, block_index: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache[block_index]`` in ``dtype``, dequantised with ``scale`` when the cache is float8."""
    if not is_fp8(cache.dtype):
        return cache.index_select(0, block_index)
    stored = cache.view(torch.uint8).index_select(0, block_index).view(cache.dtype)
    return dequantize_kv(stored, scale, dtype)
