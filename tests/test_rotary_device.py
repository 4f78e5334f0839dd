"""Models are built under a ``torch.device(...)`` context (CUDA on GPUs). The rope
table must follow it for every rope type, including the ones whose inverse
frequencies come from transformers' CPU initialisers (found on an H200)."""

from __future__ import annotations

import pytest
import torch
from test_golden import ARCHS
from transformers import AutoConfig

from tokenmill.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("arch", [a for a in ARCHS if a.startswith("llama")])
def test_rope_table_is_built_on_the_ambient_device(arch, model_factory):
    config = AutoConfig.from_pretrained(model_factory(arch))
    head_size = config.hidden_size // config.num_attention_heads
    on_cpu = RotaryEmbedding(config, head_size, 64)
    with torch.device("meta"):
        on_meta = RotaryEmbedding(config, head_size, 64)
    assert on_meta.cos_cache.device.type == "meta" and on_meta.sin_cache.device.type == "meta"
    assert on_meta.cos_cache.shape == on_cpu.cos_cache.shape == (64, head_size)
