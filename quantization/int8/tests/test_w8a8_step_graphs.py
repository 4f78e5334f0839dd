"""The fused kernel in the CPU platform's step graphs: registered with an out overload
(``tokenmill_int8::w8a8_linear.out``), a call the capture records and replays from C++, so
int8 decode steps replay like float ones, with the same tokens as run eagerly."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_model
from w8a8_models import build_w8a8_pair
from worker_probe import runner

from tokenmill import LLM, SamplingParams
from tokenmill_quant_int8.kernels import cpu_kernel_runs, w8a8_linear_cpu, w8a8_linear_packed_cpu, w8a8_pack_panels_cpu

step_graph = pytest.importorskip("tokenmill_platform_cpu.step_graph")
cpu_kernels = pytest.importorskip("tokenmill_platform_cpu.kernels")
pytestmark = pytest.mark.skipif(not (cpu_kernel_runs() and cpu_kernels.kernels_available()),
                                reason="needs the int8 kernel (AVX-512 VNNI or AVX2) and the CPU platform's kernels")


def _operands(rows: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` of bfloat16 x and a 40 x 72 int8 layer (its scales, bias and row sums), seeded by ``rows``."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=generator).bfloat16()
    weight = torch.randint(-128, 128, (40, 72), generator=generator, dtype=torch.int8)
    scale, bias = torch.rand(40, generator=generator) / 100, torch.randn(40, generator=generator)
    return generator, x, weight, scale, bias, weight.sum(dim=1, dtype=torch.int32)


def _captured(layer: Callable[[], tuple[torch.Tensor]], rows: int) -> tuple[Any, torch.Tensor]:
    """``layer`` captured as a step graph of ``rows`` rows, and the output tensor its replays rewrite."""
    kernels = cpu_kernels.load_kernels()
    graph, (out,) = step_graph.capture_step_graph(kernels, layer, kernels.GraphPool(64), rows)
    return graph, out


@pytest.mark.parametrize("rows", [1, 7, 64])  # the kernel's tiles (below 8 rows) and its panels
def test_a_captured_w8a8_call_replays_on_new_inputs(rows: int) -> None:
    generator, x, weight, scale, bias, row_sum = _operands(rows)

    def layer() -> tuple[torch.Tensor]:
        return (w8a8_linear_cpu(x, weight, scale, row_sum, bias),)

    graph, out = _captured(layer, rows)
    assert [name for name, _ in graph.profile()] == ["tokenmill_int8::w8a8_linear.out"]
    for _ in range(2):
        x.copy_(torch.randn(rows, 72, generator=generator).bfloat16() * 3)
        graph.replay()
        assert torch.equal(out, layer()[0])


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_a_captured_call_over_packed_panels_replays_on_new_inputs(rows: int) -> None:
    """What a loaded layer runs (its weight packed into panels) is recorded as the packed op's out overload."""
    generator, x, weight, scale, bias, row_sum = _operands(rows)
    panels = w8a8_pack_panels_cpu(weight)

    def layer() -> tuple[torch.Tensor]:
        return (w8a8_linear_packed_cpu(x, panels, 72, scale, row_sum, bias),)

    graph, out = _captured(layer, rows)
    assert [name for name, _ in graph.profile()] == ["tokenmill_int8::w8a8_linear_packed.out"]
    for _ in range(2):
        x.copy_(torch.randn(rows, 72, generator=generator).bfloat16() * 3)
        graph.replay()
        assert torch.equal(out, w8a8_linear_cpu(x, weight, scale, row_sum, bias))


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory) -> Path:
    quantized = tmp_path_factory.mktemp("w8a8")
    build_w8a8_pair(build_model(tmp_path_factory.mktemp("llama"), "llama"), quantized,
                    tmp_path_factory.mktemp("dequantized"))
    return quantized


def test_int8_decode_steps_replay_with_the_eager_tokens(w8a8_checkpoint: Path) -> None:
    """Every decode batch size (requests finishing one after another) gets a graph, lm_head
    included, and seeded sampling gives what the same engine gives run eagerly."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(4, 30))]} for _ in range(5)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)]

    def sampled(llm: LLM) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    options = {"dtype": "bfloat16", "max_model_len": 128, "kv_cache_memory": "16MiB", "attention_backend": "cpu-paged"}
    graphed = LLM(str(w8a8_checkpoint), **options)
    assert sampled(graphed) == sampled(LLM(str(w8a8_checkpoint), enforce_eager=True, **options))
    graphs = runner(graphed).graphs
    assert graphs.batch_sizes == graphs.lm_head_batch_sizes == [1, 2, 3, 4, 5]
    assert graphs.eager_batch_sizes == []
