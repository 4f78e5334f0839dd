"""The segment path (tokens grouped by slot, one grouped matmul per half) against the dense
masked one, on a mixed batch with base tokens, an unused slot and a merged layer's slices."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import MergedLinear, ModelBuildContext
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch, wrap_linear
from tokenmill.lora.segments import grouped_mm_works, slot_segments

SLOTS, MAX_RANK = 3, 8


def test_segments_order_the_adapter_tokens_by_slot_and_skip_the_base_ones():
    segments = slot_segments(torch.tensor([2, -1, 0, 2, -1, 0, 0]), SLOTS)
    assert segments.order.tolist() == [2, 5, 6, 0, 3]
    assert segments.ends.tolist() == [3, 3, 5]  # slot 1 unused: an empty segment


@pytest.mark.skipif(not grouped_mm_works(torch.device("cpu"), torch.float32, SLOTS, 2 * MAX_RANK, 12, 10),
                    reason="this torch has no grouped_mm for float32 on the CPU")
def test_the_segment_path_adds_what_the_dense_path_adds():
    torch.manual_seed(0)
    layer = MergedLinear(12, [6, 4], ctx=ModelBuildContext(hf_config=None, params_dtype=torch.float32))
    weights = wrap_linear(layer, SLOTS, MAX_RANK, LoRABatch())
    assert weights.segmented
    weights.set_slot(0, [LoRAModuleWeights(torch.randn(3, 12), torch.randn(6, 3)), None])
    weights.set_slot(2, [LoRAModuleWeights(torch.randn(8, 12), torch.randn(6, 8)),
                         LoRAModuleWeights(torch.randn(5, 12), torch.randn(4, 5))])
    slots = torch.tensor([2, -1, 0, 2, -1, 0, 2, 0])
    mask = torch.nn.functional.one_hot(slots + 1, SLOTS + 1)[:, 1:].float()
    x, base = torch.randn(len(slots), 12), torch.randn(len(slots), 10)
    dense = weights.delta_into(x, base.clone(), mask)
    segmented = weights.delta_into(x, base.clone(), mask, segments=slot_segments(slots, SLOTS))
    torch.testing.assert_close(segmented, dense, rtol=0, atol=1e-5)
    assert torch.equal(segmented[slots < 0], base[slots < 0])  # base tokens untouched
    assert not torch.allclose(segmented[slots >= 0], base[slots >= 0])
