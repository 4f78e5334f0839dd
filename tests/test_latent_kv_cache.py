"""The latent KV cache (``KVCacheSpec`` kind ``"latent"``) and DeepSeek's absorbed latent attention.

The torch/SDPA reference over paged latent entries against the definition (the attention kit's
paged batches: blocks in random order, garbage in every slot nobody wrote); and one MLA layer
in its absorbed form, over a latent cache filled by an earlier step (a chunked prefill beside a
decode and a fresh prompt), against the decompressed keys and values it replaces.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from tokenmill.attention import AttentionMetadata, KVCacheSpec, latent_attention, write_latent
from tokenmill.kv_cache.fp8 import dequantize_kv, quantize_kv
from tokenmill.layers import ModelBuildContext
from tokenmill.testing.attention_cases import AttentionCase, build_paged_batch, reference_attention
from tokenmill_models_moe.mla import MLAttention

LATENT, ROPE = 32, 8
CASES = [
    AttentionCase("mixed", ((9, 1), (0, 13), (3, 1), (6, 20))),
    AttentionCase("chunked-cached-prefix", ((12, 5), (8, 9), (4, 4)), block_size=1),
    AttentionCase("padded-block-table", ((9, 1), (0, 6), (2, 1)), padded_block_table=True, spare_blocks=8),
]


def test_a_latent_spec_is_one_tensor_bound_as_key_and_value():
    latent = KVCacheSpec("latent", 1, LATENT + ROPE)
    key, value = latent.allocate(lambda shape, dtype: torch.zeros(shape, dtype=dtype), 3, 16, torch.float32)
    assert key is value and key.shape == (3, 16, 1, LATENT + ROPE)
    assert latent.bytes_per_block(16, torch.bfloat16) == 16 * (LATENT + ROPE) * 2
    assert KVCacheSpec("kv", 4, 32).bytes_per_block(16, torch.bfloat16) == 2 * 16 * 4 * 32 * 2


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_latent_reference_matches_the_definition(case):
    """Every head scores all of an entry's features and sums the entries' latent part."""
    batch = build_paged_batch(replace(case, num_heads=4, num_kv_heads=1, head_size=LATENT + ROPE), "cpu",
                              torch.float32)
    cache = batch.key_cache
    write_latent(cache, batch.metadata.slot_mapping, batch.key[:, 0])
    truth = reference_attention(replace(batch, sequence_values=[k[..., :LATENT] for k in batch.sequence_keys]))
    out = latent_attention(batch.query, cache, batch.metadata, (LATENT + ROPE) ** -0.5, LATENT)
    torch.testing.assert_close(out.double(), truth, atol=2e-5, rtol=1e-4)


def test_an_fp8_latent_cache_holds_the_rounded_entries():
    """Stored as ``entry / scale`` in float8, read back times the scale: exact over the rounded entries."""
    batch = build_paged_batch(replace(CASES[0], num_heads=4, num_kv_heads=1, head_size=LATENT + ROPE), "cpu",
                              torch.float32)
    scale, fp8 = 0.5, torch.float8_e4m3fn
    cache = quantize_kv(batch.key_cache, scale, fp8)
    write_latent(cache, batch.metadata.slot_mapping, batch.key[:, 0], scale)
    rounded = [dequantize_kv(quantize_kv(k, scale, fp8), scale, torch.float32) for k in batch.sequence_keys]
    truth = reference_attention(replace(batch, sequence_keys=rounded, sequence_values=[k[..., :LATENT] for k in rounded]))
    out = latent_attention(batch.query, cache, batch.metadata, (LATENT + ROPE) ** -0.5, LATENT, scale)
    torch.testing.assert_close(out.double(), truth, atol=2e-5, rtol=1e-4)


def _metadata(requests: list[tuple[int, int]], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """One step: request i has ``requests[i] = (cached, new)`` tokens, its blocks ``tables[i]``."""
    query_lens = np.array([new for _, new in requests], dtype=np.int64)
    seq_lens = np.array([cached + new for cached, new in requests], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    table = np.array([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=np.int64)
    slots = [tables[i][pos // block_size] * block_size + pos % block_size
             for i, (cached, new) in enumerate(requests) for pos in range(cached, cached + new)]
    return AttentionMetadata(
        num_reqs=len(requests), num_actual_tokens=int(starts[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=block_size, query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(seq_lens), context_lens=torch.from_numpy(seq_lens - query_lens),
        block_table=torch.from_numpy(table), slot_mapping=torch.tensor(slots), query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens)


def _decompressed(mla: MLAttention, hidden: torch.Tensor) -> torch.Tensor:
    """One whole sequence the way the decompressed cache computed it: every head's key
    (``kv_b_proj``'s key half of the latent, then the shared rotary key) and value, causal."""
    tokens, heads = hidden.shape[0], mla.num_heads
    q_nope, q_rot = mla._query(hidden).view(tokens, heads, -1).split([mla.nope_size, mla.rope_size], -1)
    latent, k_rot = mla.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.rope_size], -1)
    q_rot, k_rot = mla.rotary_emb(torch.arange(tokens), mla._rope_layout(q_rot),
                                  mla._rope_layout(k_rot.reshape(tokens, 1, mla.rope_size)))
    k_nope, value = mla.kv_b_proj(mla.kv_a_layernorm(latent.contiguous())).view(tokens, heads, -1).split(
        [mla.nope_size, mla.v_size], -1)
    query = torch.cat([q_nope, q_rot], -1).transpose(0, 1)
    key = torch.cat([k_nope, k_rot.expand(tokens, heads, mla.rope_size)], -1).transpose(0, 1)
    out = F.scaled_dot_product_attention(query, key, value.transpose(0, 1), is_causal=True, scale=mla.attn.scale)
    return mla.o_proj(out.transpose(0, 1).reshape(tokens, -1))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_attention_over_the_latent_cache_matches_the_decompressed_one(q_lora_rank):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=LATENT,
                                           qk_nope_head_dim=24, qk_rope_head_dim=ROPE, v_head_dim=16,
                                           q_lora_rank=q_lora_rank, max_position_embeddings=64)
    mla = MLAttention(config, 0, ModelBuildContext(hf_config=config), rope_interleaved=True)
    with torch.no_grad():
        for name, param in mla.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "layernorm" in name else 0.2 * torch.randn_like(param))
    block_size, requests = 4, [(6, 5), (9, 1), (0, 7)]  # a prompt's second chunk, a decode, a new prompt
    order = torch.randperm(16).tolist()
    tables = [[order.pop() for _ in range(-(-(cached + new) // block_size))] for cached, new in requests]
    spec = mla.attn.kv_cache_spec
    assert spec == KVCacheSpec("latent", 1, LATENT + ROPE)
    cache = spec.allocate(lambda shape, dtype: 100 * torch.randn(shape, dtype=dtype), 16, block_size, torch.float32)
    mla.attn.bind(cast(Any, None), cache)  # no backend: a latent layer reads its own cache
    hidden = [torch.randn(cached + new, 64) for cached, new in requests]
    with torch.inference_mode():
        cached_first = [i for i, (cached, _) in enumerate(requests) if cached]  # an earlier step, whole prompts
        mla(torch.cat([torch.arange(requests[i][0]) for i in cached_first]),
            torch.cat([hidden[i][: requests[i][0]] for i in cached_first]),
            _metadata([(0, requests[i][0]) for i in cached_first], [tables[i] for i in cached_first], block_size))
        positions = torch.cat([torch.arange(cached, cached + new) for cached, new in requests])
        new_hidden = torch.cat([h[cached:] for h, (cached, _) in zip(hidden, requests, strict=True)])
        out = mla(positions, new_hidden, _metadata(requests, tables, block_size))
        truth = torch.cat([_decompressed(mla, h)[cached:] for h, (cached, _) in zip(hidden, requests, strict=True)])
    torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-4)
