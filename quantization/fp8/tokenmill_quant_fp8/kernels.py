"""FP8 quantization and matmuls: ``torch._scaled_mm`` and the torch reference it is tested against.

Activations are quantized per token (one scale per row of ``x``, from its absolute
maximum), weights carry one scale per output channel; ``_scaled_mm`` takes exactly
that pair ("row-wise" scaling: ``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]``, both
float32) and refuses mixed pairs (a per-token ``scale_a`` with a single
``scale_b``), so a per-tensor weight scale is expanded to one per channel rather
than the activations being reduced to one scale.

Block-wise checkpoints (one scale per 128x128 weight block, activations per token
and per 128-column group) are a sum over column groups of row-wise products: group
``g`` of ``x`` has one scale per token, and column block ``g`` of the weight one
scale per output row (its row block's), so :func:`fp8_block_linear_scaled_mm` makes
one ``_scaled_mm`` call per group; :func:`fp8_block_linear_reference` dequantises.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to float8_e4m3fn (saturated at +-448: e4m3fn has no inf)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of a 2-d ``x``: ``(fp8 [M, K], float32 scales [M, 1])``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    return quantize_fp8(x, scale), scale


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [N, K], float32 scales [N])``: each output channel scaled to e4m3's range."""
    scale = weight.abs().amax(dim=1).float().clamp(min=_MIN_SCALE) / FP8_MAX
    return quantize_fp8(weight, scale[:, None]), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and per ``group`` columns (the last group may be short):
    ``(fp8 [M, K], float32 scales [M, ceil(K / group)])``."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX
    return quantize_fp8(padded, scale[..., None]).view(m, groups * group)[:, :k], scale


def fp8_linear_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale[:, None]).T + bias`` in float32."""
    out = (xq.float() @ weight.float().t()) * x_scale * weight_scale.float()[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def fp8_linear_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product through ``torch._scaled_mm`` (row-wise scales; the weight is
    ``[N, K]`` row-major, so ``weight.t()`` is the column-major ``[K, N]`` it wants)."""
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale.float(), scale_b=weight_scale.float().view(1, -1),
                            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """Block-wise FP8: ``x`` quantized per token and per ``block[1]`` columns, the
    weight dequantised with one scale per ``block`` (``weight_scale_inv`` ``[ceil(N /
    block[0]), ceil(K / block[1])]``, the name DeepSeek-V3 checkpoints use for the
    scale that multiplies back), then a float32 matmul."""
    n, k = weight.shape
    xq, x_scale = quantize_per_token_group(x, block[1])
    x_dequant = xq.float() * x_scale.repeat_interleave(block[1], dim=1)[:, :k]
    scale = weight_scale_inv.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    out = x_dequant @ (weight.float() * scale).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def block_scales_per_row(weight_scale_inv: torch.Tensor, rows: int, out_features: int) -> torch.Tensor:
    """``[ceil(N / rows), G]`` block scales as ``[G, N]``: column group ``g``'s scale of each output row."""
    return weight_scale_inv.float().repeat_interleave(rows, dim=0)[:out_features].t().contiguous()


def fp8_block_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """Block-wise FP8 as one row-wise ``_scaled_mm`` per column group, summed in float32
    (``row_scales``: :func:`block_scales_per_row`)."""
    k, cols = weight.shape[1], block[1]
    xq, x_scale = quantize_per_token_group(x, cols)
    out = torch.zeros(x.shape[0], weight.shape[0], device=x.device)
    for g, start in enumerate(range(0, k, cols)):
        columns = slice(start, min(start + cols, k))
        out += torch._scaled_mm(xq[:, columns], weight[:, columns].t(), scale_a=x_scale[:, g:g + 1].contiguous(),
                                scale_b=row_scales[g:g + 1], out_dtype=torch.float32)
    return (out if bias is None else out + bias.float()).to(x.dtype)


@functools.cache
def scaled_mm_runs_on(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales runs on ``device`` (tried once,
    on a tiny product: builds and devices differ in what they implement)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False  # FP8 tensor cores start with Ada / Hopper
    try:
        a = torch.zeros(16, 16, device=device, dtype=FP8_DTYPE)
        scale = torch.ones(16, 1, device=device)
        fp8_linear_scaled_mm(a, scale, a, scale.view(-1), None, torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def choose_fp8_gemm(device: torch.device, in_features: int, out_features: int, block_cols: int | None = None) -> str:
    """``"scaled_mm"`` or ``"reference"`` for a layer of this shape on ``device`` (block-wise:
    ``block_cols`` columns a group), logged once per device, kind, path and reason. CUDA's
    kernels want K and N (and a block's columns) multiples of 16."""
    kind = "fp8" if block_cols is None else "block-wise fp8"
    if not scaled_mm_runs_on(device):
        return _chosen(device, kind, "reference", f"torch._scaled_mm does not run on {device.type}")
    if device.type == "cuda" and any(size % 16 for size in (in_features, out_features, block_cols or 16)):
        return _chosen(device, kind, "reference", "torch._scaled_mm on cuda needs K, N and block columns "
                                                  "multiples of 16")
    return _chosen(device, kind, "scaled_mm", "row-wise scales" if block_cols is None else "one call per column group")


@functools.cache
def _chosen(device: torch.device, kind: str, path: str, reason: str) -> str:
    logger.info("%s linear layers on %s: %s path (%s)", kind, device, path, reason)
    return path
