"""Triton shrink and expand for batched LoRA on a GPU, in the manner of punica's BGMV.

The torch path (:meth:`tokenmill.lora.layers.LoRAWeights.delta_into`) shrinks every token
against every slot's A and masks all but the token's own slot: ``num_slots`` times the work
it keeps. Here each token reads only its own slot's rows, by its slot index:

* shrink: ``y[t, c] = sum_k x[t, k] * A[slot(t) * C + c, k]`` for the ``C = slices * max_rank``
  columns of one slot (program: a token and a block of columns, looping over ``k``);
* expand: ``out[t, o] += sum_c y[t, c] * B[o, slot(t) * C + c]`` (program: a token and a
  block of outputs). B is block-diagonal over a merged layer's slices, so one pass over a
  slot's ``C`` columns puts every slice's delta in its rows.

A token of the base model (slot -1) does nothing in either kernel. Accumulation is in
float32. Tested against the torch path under ``TRITON_INTERPRET=1`` on the CPU
(tests/test_lora_triton.py), and on CUDA where a GPU is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K, BLOCK_C, BLOCK_N = 32, 16, 32


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, y_ptr, k_size, columns,
            stride_xt, stride_ar, stride_yt,
            block_k: tl.constexpr, block_c: tl.constexpr):
    token = tl.program_id(0)
    offs_c = tl.program_id(1) * block_c + tl.arange(0, block_c)
    slot = tl.load(slots_ptr + token)
    c_valid = offs_c < columns
    acc = tl.zeros((block_c,), dtype=tl.float32)
    if slot >= 0:
        rows = slot * columns + offs_c
        for k0 in range(0, k_size, block_k):
            offs_k = k0 + tl.arange(0, block_k)
            k_valid = offs_k < k_size
            x = tl.load(x_ptr + token * stride_xt + offs_k, mask=k_valid, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + rows[:, None] * stride_ar + offs_k[None, :],
                        mask=c_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + token * stride_yt + offs_c, acc, mask=c_valid)


@triton.jit
def _expand(y_ptr, b_ptr, slots_ptr, out_ptr, n_size, columns,
            stride_yt, stride_bn, stride_ot,
            block_c: tl.constexpr, block_n: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * block_n + tl.arange(0, block_n)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        n_valid = offs_n < n_size
        acc = tl.zeros((block_n,), dtype=tl.float32)
        for c0 in range(0, columns, block_c):
            offs_c = c0 + tl.arange(0, block_c)
            c_valid = offs_c < columns
            y = tl.load(y_ptr + token * stride_yt + offs_c, mask=c_valid, other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + (slot * columns + offs_c)[None, :],
                        mask=n_valid[:, None] & c_valid[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * y[None, :], axis=1)
        pointers = out_ptr + token * stride_ot + offs_n
        base = tl.load(pointers, mask=n_valid, other=0.0).to(tl.float32)
        tl.store(pointers, (base + acc).to(out_ptr.dtype.element_ty), mask=n_valid)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[T, C]`` float32: each token's projection onto its own slot's ``C`` A rows (0 for slot -1)."""
    tokens, k_size = x.shape
    columns = lora_a.shape[0] // num_slots
    x, lora_a = x.contiguous(), lora_a.contiguous()
    y = torch.empty(tokens, columns, device=x.device, dtype=torch.float32)
    if tokens:
        _shrink[(tokens, triton.cdiv(columns, BLOCK_C))](
            x, lora_a, token_slots, y, k_size, columns, x.stride(0), lora_a.stride(0), y.stride(0),
            block_k=BLOCK_K, block_c=BLOCK_C)
    return y


def lora_expand_into(y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor,
                     num_slots: int) -> torch.Tensor:
    """``out[t] += B_slot(t) y[t]`` in place (rows of slot -1 untouched)."""
    tokens, n_size = out.shape
    columns = lora_b.shape[1] // num_slots
    target = out if out.is_contiguous() else out.contiguous()  # the kernel writes rows of unit stride
    lora_b = lora_b.contiguous()
    if tokens:
        _expand[(tokens, triton.cdiv(n_size, BLOCK_N))](
            y, lora_b, token_slots, target, n_size, columns, y.stride(0), lora_b.stride(0), target.stride(0),
            block_c=BLOCK_C, block_n=BLOCK_N)
    if target is not out:
        out.copy_(target)
    return out


def lora_delta_into(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """What ``LoRAWeights.delta_into`` computes, by slot index instead of a one-hot mask."""
    return lora_expand_into(lora_shrink(x, lora_a, token_slots, num_slots), lora_b, token_slots, out, num_slots)
