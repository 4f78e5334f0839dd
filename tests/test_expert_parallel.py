"""Expert parallelism: whole experts placed on the tensor-parallel ranks.

The layer tests build each rank's ``FusedMoE`` in this process (a build context per rank, its
communicator the one-rank no-op, ``reduce_results=False``) and do the all-reduce by hand,
against the layer that holds every expert. The engine tests start the "mp" executor (two
spawned processes over gloo on 127.0.0.1) and compare greedy tokens with transformers: a
Mixtral of 7 experts (4 on rank 0, 3 on rank 1) and a Qwen2-MoE with a shared expert and a
dense layer (both tensor-parallel as before), with chunked prefill and preemption in the run.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from moe_models import build_moe_model
from test_golden import _assert_matches
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.executor.expert_parallel import check_expert_parallel
from tokenmill.layers import (
    ExpertPlacement,
    FusedMoE,
    FusedMoEMethod,
    ModelBuildContext,
    MoERouting,
    held_checkpoint_tensors,
)
from tokenmill.layers.linear import process_weights_after_loading

MAX_NEW = 10
HIDDEN, INTER, EXPERTS = 12, 8, 8
PREFIX = "model.layers.0.block_sparse_moe.experts"


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]


def _expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors of one layer, Mixtral's names (w1 gate, w3 up, w2 down)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(EXPERTS):
        tensors[f"{e}.w1.weight"] = torch.randn(INTER, HIDDEN, generator=gen)
        tensors[f"{e}.w3.weight"] = torch.randn(INTER, HIDDEN, generator=gen)
        tensors[f"{e}.w2.weight"] = torch.randn(HIDDEN, INTER, generator=gen)
    return tensors


def _stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same experts as an already-fused checkpoint holds them."""
    gate_up = [torch.cat([tensors[f"{e}.w1.weight"], tensors[f"{e}.w3.weight"]]) for e in range(EXPERTS)]
    return {"gate_up_proj": torch.stack(gate_up),
            "down_proj": torch.stack([tensors[f"{e}.w2.weight"] for e in range(EXPERTS)])}


def _fp8_method() -> FusedMoEMethod:
    from tokenmill_quant_fp8.moe import Fp8OnlineMoEMethod

    return Fp8OnlineMoEMethod()


def _layer(rank: int = 0, world_size: int = 1, expert_parallel: bool = False,
           method: Callable[[], FusedMoEMethod] | None = None) -> FusedMoE:
    ctx = ModelBuildContext(hf_config=None, prefix=PREFIX, rank=rank, world_size=world_size,
                            params_dtype=torch.float32, expert_parallel=expert_parallel)
    return FusedMoE(EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                    expert_names=("w1", "w3", "w2"), reduce_results=False,
                    quant_method=method() if method is not None else None)


def _loaded(layer: FusedMoE, checkpoint: dict[str, torch.Tensor]) -> FusedMoE:
    for name, tensor in checkpoint.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == []
    process_weights_after_loading(layer)
    return layer


def test_placement_gives_every_expert_to_one_rank_the_first_ranks_one_more():
    for experts, ranks in [(8, 2), (8, 3), (7, 2), (4, 4), (9, 4)]:
        shares = [ExpertPlacement.for_rank(experts, r, ranks) for r in range(ranks)]
        owners = [[r for r, share in enumerate(shares) if share.holds(e)] for e in range(experts)]
        assert owners == [[owner] for owner in sorted(o for o, in owners)], (experts, ranks)
        counts = [share.count for share in shares]
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True), (experts, ranks)
    assert [ExpertPlacement.for_rank(8, r, 3).count for r in range(3)] == [3, 3, 2]
    with pytest.raises(ValueError, match="needs at least 4 experts, not 3"):
        ExpertPlacement.for_rank(3, 0, 4)


@pytest.mark.parametrize(("layout", "method"), [("per_expert", None), ("stacked", None), ("per_expert", _fp8_method)],
                         ids=["per-expert", "stacked", "fp8-online"])
def test_three_ranks_of_whole_experts_sum_to_the_whole_layer(layout, method):
    """8 experts over 3 ranks (3, 3, 2): each rank holds its experts whole and runs only the
    token-expert pairs routed to them; the partial outputs add up to the one-rank layer's
    (FP8 experts too: quantized per expert and row, so the rank's share quantizes alike)."""
    torch.manual_seed(1)
    tensors = _expert_tensors()
    checkpoint = tensors if layout == "per_expert" else _stacked(tensors)
    x, logits = torch.randn(7, HIDDEN), torch.randn(7, EXPERTS) * 2
    whole = _loaded(_layer(method=method), checkpoint)
    expected = whole(x, logits)
    total = torch.zeros_like(expected)
    for rank in range(3):
        layer = _loaded(_layer(rank, 3, expert_parallel=True, method=method), checkpoint)
        first, count = layer.placement.first, layer.num_local_experts
        assert (first, count) == [(0, 3), (3, 3), (6, 2)][rank]
        assert tuple(layer.gate_up_proj.shape) == (count, 2 * INTER, HIDDEN)  # whole experts, unsplit
        torch.testing.assert_close(layer.down_proj, whole.down_proj[first:first + count], rtol=0, atol=0)
        total += layer(x, logits)
        assert torch.equal(layer.expert_load, whole.expert_load)  # every rank counts every global expert id
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_a_rank_reads_only_its_experts_and_names_its_missing_one_by_global_id():
    layer = _layer(1, 2, expert_parallel=True)  # experts 4-7
    model = torch.nn.ModuleDict({"experts": layer})
    holds = held_checkpoint_tensors(model)
    assert holds is not None
    assert not holds(f"{PREFIX}.3.w1.weight") and holds(f"{PREFIX}.4.w1.weight") and holds(f"{PREFIX}.7.w2.weight")
    assert holds("model.layers.0.block_sparse_moe.gate.weight") and holds("model.embed_tokens.weight")
    assert held_checkpoint_tensors(torch.nn.ModuleDict({"experts": _layer()})) is None
    for name, tensor in _expert_tensors().items():
        if name != "6.w3.weight":
            layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == [f"{PREFIX}.6.w3.weight"]


def test_fewer_experts_than_ranks_is_an_error_before_any_worker(tmp_path):
    with pytest.raises(ValueError, match="the model's 3 experts cannot be placed on tensor_parallel_size=4 ranks"):
        check_expert_parallel(SimpleNamespace(num_local_experts=3), 4, enabled=True)
    check_expert_parallel(SimpleNamespace(num_local_experts=3), 4, enabled=False)
    check_expert_parallel(SimpleNamespace(n_routed_experts=5), 2, enabled=True)  # uneven: 3 and 2


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """Mixtral with 7 experts: two ranks hold 4 and 3."""
    folder = build_moe_model(tmp_path_factory.mktemp("mixtral7"), "mixtral", num_local_experts=7)
    return folder, hf_greedy(folder, _prompts(), MAX_NEW)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    folder = build_moe_model(tmp_path_factory.mktemp("qwen2-moe"), "qwen2-moe")
    return folder, hf_greedy(folder, _prompts(), MAX_NEW)


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)


def test_fewer_experts_than_ranks_fails_the_engine_start(mixtral, tmp_path):
    shutil.copytree(mixtral[0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_local_experts"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 experts cannot be placed on tensor_parallel_size=4 ranks"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", tensor_parallel_size=4,
            enable_expert_parallel=True)


def test_with_one_rank_expert_parallelism_is_a_logged_no_op(mixtral, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.executor.expert_parallel"):
        llm = LLM(str(mixtral[0]), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
                  enable_expert_parallel=True)
    assert "enable_expert_parallel has no effect: one tensor-parallel rank holds every expert" in caplog.text
    _assert_matches(_generate(llm), mixtral[1])


def _rank_experts(worker) -> dict[str, object]:
    """On each rank: its MoE layers' placements and stacked shapes, and their expert-load counters."""
    from tokenmill.layers import FusedMoE, expert_load_by_layer

    model = worker.runner.model
    layers = {m.prefix: m for m in model.modules() if isinstance(m, FusedMoE)}
    return {"placement": {p: (m.placement.first, m.num_local_experts, tuple(m.gate_up_proj.shape))
                          for p, m in layers.items()},
            "loads": expert_load_by_layer(model)}


@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_two_expert_parallel_ranks_match_transformers(model, request):
    """Whole experts on two ranks (Mixtral's 7 unevenly), attention, the dense layer and the
    shared expert split by tensor parallelism; with chunked prefill and preemption. Each rank's
    expert-load counters count every global expert id."""
    folder, expected = request.getfixturevalue(model)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, num_kv_blocks=10, max_num_batched_tokens=32,
              tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        outputs = _generate(llm)
        assert llm.engine.scheduler_stats.num_preemptions > 0
        _assert_matches(outputs, expected)
        ranks = llm.engine.core.executor.collective_rpc(_rank_experts)
    finally:
        llm.engine.shutdown()
    experts, intermediate = (7, 128) if model == "mixtral" else (8, 32)
    shares = [(0, 4), (4, 3)] if experts == 7 else [(0, 4), (4, 4)]
    for rank, answer in enumerate(ranks):
        assert answer["placement"], "no MoE layer"
        for prefix, (first, count, gate_up_shape) in answer["placement"].items():
            assert (first, count) == shares[rank], prefix
            assert gate_up_shape == (count, 2 * intermediate, 64), prefix  # whole experts: the intermediate unsplit
    # top-2 of every computed token (recomputed ones again after a preemption), on both ranks alike
    computed = sum(len(p) for p in _prompts()) + len(_prompts()) * (MAX_NEW - 1)
    assert ranks[0]["loads"] == ranks[1]["loads"]
    for layer, load in ranks[0]["loads"].items():
        assert len(load) == experts and sum(load) >= 2 * computed and sum(load) % 2 == 0, layer
