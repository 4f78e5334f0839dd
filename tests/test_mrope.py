"""M-RoPE (tokenmill.layers.mrope) against transformers' Qwen2-VL: the three-section rotary of
queries and keys, and the prompt positions of get_rope_index, on made-up inputs."""

from __future__ import annotations

import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLModel,
    Qwen2VLRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tokenmill.layers import MRopeItem, MRotaryEmbedding, RotaryEmbedding, mrope_prompt_positions

TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})


def _config() -> Qwen2VLConfig:
    return Qwen2VLConfig(text_config=TEXT, vision_config=dict(spatial_merge_size=2))


def test_three_sections_rotate_as_transformers():
    config = _config()
    positions = torch.randint(0, 100, (3, 9))
    q, k = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    hf_cos, hf_sin = Qwen2VLRotaryEmbedding(config.text_config)(q, positions[:, None, :])
    expected = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    got = MRotaryEmbedding(config.text_config, 16, 128)(positions, q.clone(), k.clone())
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs[0].transpose(0, 1))


def test_equal_sections_are_the_plain_rotary():
    config = _config()
    positions = torch.arange(7)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    plain = RotaryEmbedding(config.text_config, 16, 128)(positions, q.clone(), k.clone())
    rope = MRotaryEmbedding(config.text_config, 16, 128)
    for three, one, reference in zip(rope(positions.expand(3, -1), q.clone(), k.clone()),
                                     rope(positions, q.clone(), k.clone()), plain, strict=True):
        torch.testing.assert_close(three, reference)
        torch.testing.assert_close(one, reference)


def test_prompt_positions_are_get_rope_index():
    """Text, an image of 2x3 merged tokens, text, a video of 2 frames of 2x2, text."""
    config = _config()
    types = [0] * 3 + [1] * 6 + [0] * 2 + [2] * 8 + [0] * 4
    model = Qwen2VLModel.__new__(Qwen2VLModel)
    model.config = config
    expected, delta = Qwen2VLModel.get_rope_index(
        model, torch.zeros(1, len(types), dtype=torch.long), torch.tensor([types]),
        image_grid_thw=torch.tensor([[1, 4, 6]]), video_grid_thw=torch.tensor([[2, 4, 4]]))
    positions, ours = mrope_prompt_positions(len(types), [MRopeItem(3, 1, 2, 3), MRopeItem(11, 2, 2, 2)])
    assert positions.tolist() == expected[:, 0].tolist()
    assert ours == int(delta)
