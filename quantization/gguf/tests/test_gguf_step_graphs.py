"""GGUF decode steps in the CPU platform's step graphs: the kernel's ops (``tokenmill_gguf::matmul``
and ``::embedding``) have out overloads the capture records, and a merged layer whose shards keep
different block types joins its parts with ``torch.cat``, which the capture lowers too; so every
decode batch size of a GGUF model replays from C++, with the tokens the same engine gives eagerly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_kernels import features, packed
from test_gguf_loader import tiny_model, write_llama_cpp_gguf
from test_gguf_quantized_model import MIXES
from worker_probe import runner

from tokenmill import LLM, SamplingParams
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kernels import gguf_embedding

cpu_kernels = pytest.importorskip("tokenmill_platform_cpu.kernels")
pytestmark = pytest.mark.skipif(load_cpu_kernel() is None or not cpu_kernels.kernels_available(),
                                reason="needs the GGUF CPU kernel and the CPU platform's kernels")


@pytest.mark.parametrize("qtype", sorted(KEPT_QUANTIZED, key=int), ids=lambda t: t.name)
def test_the_embedding_op_returns_the_reference_rows(qtype: GGMLQuantizationType) -> None:
    dim = features(qtype, 2)
    table = packed(11, dim, qtype, seed=int(qtype))
    ids = torch.tensor([3, 0, 10, 3, 7])
    expected = dequantize_rows(table[ids], qtype, dim)
    torch.testing.assert_close(gguf_embedding(table, ids, qtype, dim), expected, rtol=1e-6, atol=0)
    out = torch.full((5, dim), float("nan"))
    torch.ops.tokenmill_gguf.embedding.out(table, ids, int(qtype), dim, out=out)
    assert torch.equal(out, gguf_embedding(table, ids, qtype, dim))


def test_an_id_outside_the_table_is_an_error() -> None:
    table = packed(4, 32, GGMLQuantizationType.Q4_0)
    with pytest.raises(RuntimeError, match="outside the table"):
        gguf_embedding(table, torch.tensor([4]), GGMLQuantizationType.Q4_0, 32)


@pytest.mark.parametrize("mix", ["Q4_1", "mixed"])  # mixed: q/k Q4_0 and v Q8_0 in one merged layer
def test_gguf_decode_steps_replay_with_the_eager_tokens(tmp_path: Path, mix: str) -> None:
    path = tmp_path / f"tiny-{mix}.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=True), path, "llama", MIXES[mix])
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(4, 20))]} for _ in range(4)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(4)]

    def sampled(llm: LLM) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    options = {"dtype": "float32", "max_model_len": 64, "kv_cache_memory": "8MiB"}
    graphed = LLM(str(path), **options)
    assert sampled(graphed) == sampled(LLM(str(path), enforce_eager=True, **options))
    graphs = runner(graphed).graphs
    assert graphs.batch_sizes == graphs.lm_head_batch_sizes == [1, 2, 3, 4]
    assert graphs.eager_batch_sizes == []
