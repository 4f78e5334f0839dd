"""The C++ LoRA kernel (kernels/lora_delta.cpp) against the same sum in torch, and in a step
graph: a replay applies the slots and the weights written in place since the capture."""

from __future__ import annotations

import pytest
import torch

from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps
from tokenmill_platform_cpu.step_graph import capture_step_graph

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")

SLOTS, RANK, IN = 3, 8, 40
SLICES = [(0, 72), (72, 136)]  # a merged layer's two output slices: 64-column vector passes and tails
OUT = 208


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return CpuLayerOps(load_kernels(), packed_budget=1 << 40)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-stacked A [S * 2 * RANK, IN] and B^T [S * 2 * RANK, OUT]; slot 1's second slice of rank 3."""
    g = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(SLOTS * len(SLICES) * RANK, IN, generator=g)
    lora_b_t = torch.randn(SLOTS * len(SLICES) * RANK, OUT, generator=g)
    padded = (1 * len(SLICES) + 1) * RANK + 3
    lora_a[padded : padded + RANK - 3] = 0
    return lora_a, lora_b_t


def _reference(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """Each slice takes its own RANK rows of the token's slot, and only its own output columns."""
    out = out.clone()
    columns = len(SLICES) * RANK
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for i, (offset, size) in enumerate(SLICES):
            rows = slice(slot * columns + i * RANK, slot * columns + (i + 1) * RANK)
            out[t, offset : offset + size] += (lora_a[rows] @ x[t]) @ lora_b_t[rows, offset : offset + size]
    return out


def _flat(slices: list[tuple[int, int]]) -> list[int]:
    return [value for piece in slices for value in piece]


# 9 adapter tokens of slot 0: two full blocks of four and one of one; base tokens between
SLOTS_OF_TOKENS = [0, -1, 2, 0, 0, -1, 0, 2, 0, 0, 0, 0, 2, 0, -1]


def test_the_kernel_adds_each_tokens_own_adapter(ops):
    g = torch.Generator().manual_seed(0)
    lora_a, lora_b_t = _weights(1)
    slots = torch.tensor(SLOTS_OF_TOKENS, dtype=torch.int32)
    x = torch.randn(len(slots), IN, generator=g)
    base = torch.randn(len(slots), OUT + 6, generator=g)[:, :OUT]  # strided rows, as a view of a wider output
    out = base.clone()
    returned = ops.lora_delta_into(x, out, lora_a, lora_b_t, slots, SLOTS, _flat(SLICES))
    assert returned is out
    torch.testing.assert_close(out, _reference(x, base, lora_a, lora_b_t, slots), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[slots < 0], base[slots < 0])  # the base model's tokens untouched


def test_a_step_with_no_adapter_token_changes_nothing(ops):
    lora_a, lora_b_t = _weights(2)
    x, base = torch.randn(4, IN), torch.randn(4, OUT)
    out = ops.lora_delta_into(x, base.clone(), lora_a, lora_b_t, torch.full((4,), -1, dtype=torch.int32), SLOTS,
                              _flat(SLICES))
    assert torch.equal(out, base)


def test_bad_slots_and_shapes_are_refused(ops):
    lora_a, lora_b_t = _weights(3)
    x, out = torch.randn(2, IN), torch.randn(2, OUT)
    with pytest.raises(RuntimeError, match="has slot 3 of 3"):
        ops.lora_delta_into(x, out, lora_a, lora_b_t, torch.tensor([0, 3], dtype=torch.int32), SLOTS, _flat(SLICES))
    with pytest.raises(RuntimeError, match="outside the output"):
        ops.lora_delta_into(x, out, lora_a, lora_b_t, torch.tensor([0, 1], dtype=torch.int32), SLOTS,
                            _flat([(0, 72), (72, 137)]))


def test_a_replay_applies_the_slots_and_weights_written_since(ops):
    """The graph records the kernel after the base matmul; the caller rewrites the slots (a base
    step at capture, adapters later) and one slot's weights in place, as the model runner and
    an adapter load do."""
    g = torch.Generator().manual_seed(4)
    rows = 5
    lora_a, lora_b_t = _weights(5)
    weight = torch.randn(OUT, IN, generator=g)
    prepared = ops.prepare_linear_weight(weight)
    x = torch.randn(rows, IN, generator=g)
    slots = torch.full((rows,), -1, dtype=torch.int32)

    def run() -> tuple[torch.Tensor]:
        out = ops.linear(x, weight, None, prepared)
        return (ops.lora_delta_into(x, out, lora_a, lora_b_t, slots, SLOTS, _flat(SLICES)),)

    graph, (out,) = capture_step_graph(load_kernels(), run, load_kernels().GraphPool(rows), rows)
    torch.testing.assert_close(out, x @ weight.T)
    assert [name for name, _ in graph.profile()] == ["packed_linear", "lora_delta_"]
    slots.copy_(torch.tensor([2, -1, 0, 1, 2], dtype=torch.int32))
    x.copy_(torch.randn(rows, IN, generator=g))
    lora_a[: len(SLICES) * RANK].copy_(torch.randn(len(SLICES) * RANK, IN, generator=g))  # slot 0 reloaded
    graph.replay()
    torch.testing.assert_close(out, _reference(x, x @ weight.T, lora_a, lora_b_t, slots), rtol=1e-5, atol=1e-4)
