"""The Triton LoRA shrink/expand (tokenmill.lora.triton_kernels) against the torch path of
the wrapped layer (slot-stacked A/B, one-hot slot mask): plain and merged (three-slice)
layers, adapters of different ranks in one batch, base-model tokens, odd sizes, float32 and
bfloat16. On the CPU under ``TRITON_INTERPRET=1``, in a child pytest (the interpreter is read
when triton is first imported, and setting it here would leak into every later test), and on
CUDA where a GPU is lent (``-m gpu``, also through a whole engine step)."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.layers import Linear, MergedLinear, ModelBuildContext
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch, wrap_linear

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SLOTS, MAX_RANK = 3, 8
# (tokens, in_features, output slices): a decode token, a short and a longer mixed batch
CASES = [(1, 24, [40]), (7, 64, [16, 8, 8]), (33, 72, [48]), (20, 40, [24, 12, 12])]


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_the_interpreted_cases_pass_under_the_interpreter():
    from tokenmill.testing.child import run_pytest_child

    output = run_pytest_child(f"{__file__}::test_the_interpreted_kernel_is_the_torch_path",
                              env={"TRITON_INTERPRET": "1"})
    assert f"{len(CASES) * 2} passed" in output, output[-2000:]


def _layer(in_features: int, sizes: list[int], device: str, dtype: torch.dtype, seed: int):
    """A float32 wrapped layer with adapters of ranks 8, 3 (on some slices only) and 5 in its
    slots, their values rounded to ``dtype`` (so the float32 torch path is exact on them)."""
    generator = torch.Generator().manual_seed(seed)
    ctx = ModelBuildContext(hf_config=None, params_dtype=torch.float32)
    layer = MergedLinear(in_features, sizes, ctx=ctx) if len(sizes) > 1 else Linear(in_features, sizes[0], ctx=ctx)
    layer.to(device)
    batch = LoRABatch()
    weights = wrap_linear(layer, SLOTS, MAX_RANK, batch)
    for slot, rank in enumerate((8, 3, 5)):
        slices = [LoRAModuleWeights(torch.randn(rank, in_features, generator=generator).to(dtype).float().to(device),
                                    torch.randn(size, rank, generator=generator).to(dtype).float().to(device))
                  if slot != 1 or i == 0 else None for i, size in enumerate(sizes)]
        weights.set_slot(slot, slices)
    return weights


def _check(tokens: int, in_features: int, sizes: list[int], dtype: torch.dtype, device: str) -> None:
    from tokenmill.lora import triton_kernels

    weights = _layer(in_features, sizes, device, dtype, seed=tokens)
    generator = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, in_features, generator=generator).to(device, dtype)
    base = torch.randn(tokens, sum(sizes), generator=generator).to(device, dtype)
    if tokens == 20:
        base = base.T.contiguous().T  # a column-major output (the kernel works on a copy, then writes back)
    slots = torch.arange(tokens) % (SLOTS + 1) - 1  # every slot and the base model (-1)
    mask = torch.zeros(tokens, SLOTS + 1)
    mask[torch.arange(tokens), slots + 1] = 1
    expected = weights.delta_into(x.float(), base.float().clone(), mask[:, 1:].float().to(device))
    out = base.clone()  # (clone keeps the strides)
    ours = triton_kernels.lora_delta_into(x, out, weights.lora_a.to(dtype), weights.lora_b.to(dtype),
                                          slots.to(device, torch.int32), SLOTS)
    assert ours is out and ours.dtype == dtype
    # float32: summation order only; bfloat16: the output's own rounding (8 bits of mantissa)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(ours.float(), expected, **tolerance)
    torch.testing.assert_close(ours[slots < 0], base[slots < 0], rtol=0, atol=0)  # base tokens untouched


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("tokens", "in_features", "sizes"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_interpreted_kernel_is_the_torch_path(tokens, in_features, sizes, dtype):
    _check(tokens, in_features, sizes, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("tokens", "in_features", "sizes"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_kernel_is_the_torch_path(tokens, in_features, sizes, dtype):
    _check(tokens, in_features, sizes, dtype, "cuda")
