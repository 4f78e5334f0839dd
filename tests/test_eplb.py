"""Expert-parallel load balancing: redundant copies of hot experts, rebalanced while serving.

The placement algorithm is plain Python, tested on skewed loads. The layer test builds two
ranks' ``FusedMoE`` in this process (as tests/test_expert_parallel.py does) with copies of some
experts on both, and sums their outputs against the one-rank layer. The engine test starts two
real ranks ("mp" executor, gloo on 127.0.0.1) with one redundant slot and a rebalance every 3
steps, so the placement changes (and weights move between the processes) mid-generation, and
compares greedy tokens and logprobs with transformers; each slot's weights must then be the
checkpoint's for the expert the slot now holds.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from moe_models import build_moe_model
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.eplb.config import check_eplb, slots_per_rank
from tokenmill.eplb.placement import (
    balanced_placement,
    initial_placement,
    plan_moves,
    rank_imbalance,
)
from tokenmill.layers import FusedMoE, ModelBuildContext, MoERouting, ReplicatedExperts
from tokenmill.metrics.expert_load import ExpertLoadStatLogger, engine_expert_loads, engine_expert_replicas

MAX_NEW = 10
HIDDEN, INTER, EXPERTS = 12, 8, 8


def _copies(placement: list[int], experts: int) -> list[int]:
    return [placement.count(e) for e in range(experts)]


def _zipf(experts: int, seed: int) -> list[float]:
    """A skewed load: expert ranks drawn at random, the i-th hottest 1/(i+1) of the first."""
    order = list(range(experts))
    random.Random(seed).shuffle(order)
    return [1000.0 / (order[e] + 1) for e in range(experts)]


def test_the_hottest_experts_fill_the_redundant_slots_one_copy_a_rank():
    load = [10.0, 1000.0, 30.0, 400.0, 20.0, 50.0, 40.0, 10.0]  # experts 1 and 3 hot
    placement = balanced_placement(load, num_ranks=2, slots_per_rank=5, current=initial_placement(8, 2, 5))
    assert len(placement) == 10
    assert _copies(placement, 8) == [1, 2, 1, 2, 1, 1, 1, 1]
    for rank in range(2):
        held = placement[rank * 5:(rank + 1) * 5]
        assert len(set(held)) == 5, f"rank {rank} holds one expert twice: {held}"


@pytest.mark.parametrize(("experts", "ranks", "redundant"), [(8, 2, 0), (7, 2, 1), (8, 4, 4), (16, 4, 8)])
def test_every_expert_keeps_a_copy_and_the_ranks_load_evens_out(experts, ranks, redundant):
    slots = (experts + redundant) // ranks
    before = initial_placement(experts, ranks, slots)
    for seed in range(5):
        load = _zipf(experts, seed)
        after = balanced_placement(load, ranks, slots, current=before)
        assert len(after) == ranks * slots
        assert min(_copies(after, experts)) >= 1, "an expert lost its last copy"
        assert max(_copies(after, experts)) <= ranks
        assert rank_imbalance(after, load, ranks) < rank_imbalance(before, load, ranks), (seed, after)
    if redundant:  # the hottest expert gets a second copy
        load = _zipf(experts, 0)
        assert _copies(balanced_placement(load, ranks, slots, before), experts)[load.index(max(load))] >= 2


def test_no_load_yet_and_an_unchanged_load_move_nothing():
    before = initial_placement(7, 2, 4)
    load = _zipf(7, 3)
    after = balanced_placement(load, 2, 4, current=before)
    assert plan_moves(after, balanced_placement(load, 2, 4, current=after), 4) == []
    assert rank_imbalance(before, [0.0] * 7, 2) == 0.0


def test_the_planned_moves_turn_one_placement_into_the_other():
    """Slots hold their expert's id as data: applying the moves (sources read from the old
    slots, as the ranks do) gives the new placement, each move from a rank that held the expert."""
    old = initial_placement(8, 2, 5)
    new = balanced_placement(_zipf(8, 1), 2, 5, current=old)
    moves = plan_moves(old, new, 5)
    assert moves, "a skewed load should change the initial placement"
    slots = list(old)
    for move in moves:
        assert old[move.src_rank * 5 + move.src_slot] == move.expert
        slots[move.dst_rank * 5 + move.dst_slot] = old[move.src_rank * 5 + move.src_slot]
    assert slots == new
    assert len(moves) == sum(a != b for a, b in zip(old, new, strict=True))


def _expert_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"{e}.{w}.weight": torch.randn(*(INTER, HIDDEN) if w != "w2" else (HIDDEN, INTER), generator=gen)
            for e in range(EXPERTS) for w in ("w1", "w3", "w2")}


def _layer(rank: int = 0, world_size: int = 1, redundant: int | None = None) -> FusedMoE:
    ctx = ModelBuildContext(hf_config=None, prefix="experts", rank=rank, world_size=world_size,
                            params_dtype=torch.float32, expert_parallel=world_size > 1, redundant_experts=redundant)
    return FusedMoE(EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                    expert_names=("w1", "w3", "w2"), reduce_results=False)


def _load(layer: FusedMoE, tensors: dict[str, torch.Tensor]) -> FusedMoE:
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == []
    return layer


def test_two_ranks_with_copies_sum_to_the_whole_layer_before_and_after_a_new_placement():
    """8 experts + 2 redundant over 2 ranks (5 slots each): the token-expert pairs of a copied
    expert split over its copies, each pair run once, and the ranks' outputs add up to the
    one-rank layer's, for the initial placement and for one balanced to a skewed load."""
    torch.manual_seed(2)
    tensors = _expert_tensors()
    x, logits = torch.randn(40, HIDDEN), torch.randn(40, EXPERTS) * 2
    expected = _load(_layer(), tensors)(x, logits)
    ranks = [_load(_layer(rank, 2, redundant=2), tensors) for rank in range(2)]
    assert all(isinstance(r.placement, ReplicatedExperts) and r.num_local_experts == 5 for r in ranks)
    assert tuple(ranks[0].gate_up_proj.shape) == (5, 2 * INTER, HIDDEN)
    new = balanced_placement(_zipf(EXPERTS, 4), 2, 5, current=ranks[0].placement.physical_to_logical)
    for placement in (None, new):
        if placement is not None:  # a new placement: each rank's slots reloaded for it
            for layer in ranks:
                layer.placement.assign(placement)
                _load(layer, tensors)
        total = sum(layer(x, logits) for layer in ranks)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_a_copied_expert_s_pairs_split_evenly_over_its_copies():
    placement = ReplicatedExperts(4, rank=0, num_ranks=2, count=3, physical_to_logical=[0, 1, 2, 3, 0, 0])
    ids = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 1], [0, 3], [2, 0], [0, 1]])  # expert 0 seven times
    physical = placement.physical_ids(ids)
    assert (physical == 0).sum() + (physical == 4).sum() + (physical == 5).sum() == 7
    assert sorted(int((physical == p).sum()) for p in (0, 4, 5)) == [2, 2, 3]
    assert torch.equal(physical[ids == 1], torch.tensor([1, 1, 1]))  # one copy: always that slot
    assert placement.replicas() == [3, 1, 1, 1]
    with pytest.raises(ValueError, match=r"without a copy of experts \[3\]"):
        placement.assign([0, 1, 2, 0, 1, 2])


def test_bad_options_fail_at_start_with_the_rule_they_break():
    with pytest.raises(ValueError, match="enable_eplb balances experts over expert-parallel ranks"):
        EngineConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="num_redundant_experts=2 needs enable_eplb"):
        EngineConfig(enable_expert_parallel=True, eplb_config={"num_redundant_experts": 2})
    with pytest.raises(ValueError, match=r"7 experts \+ 2 redundant = 9 physical experts do not divide over 2 "
                                         r"expert-parallel ranks \(try 1 or 3\)"):
        slots_per_rank(7, 2, 2)
    with pytest.raises(ValueError, match=r"num_redundant_experts=11 is more than the slots allow.*at most 8"):
        slots_per_rank(4, 11, 3)
    assert slots_per_rank(4, 8, 3) == 4  # every expert on every rank: the most there can be
    ok = EngineConfig(enable_expert_parallel=True, enable_eplb=True, tensor_parallel_size=2,
                      eplb_config={"num_redundant_experts": 1, "step_interval": 3})
    check_eplb(SimpleNamespace(num_local_experts=7), 2, ok.enable_eplb, ok.eplb_config)
    with pytest.raises(ValueError, match="more than the slots allow"):
        check_eplb(SimpleNamespace(num_local_experts=3), 2, True, ok.eplb_config.model_copy(
            update={"num_redundant_experts": 5}))
    with pytest.raises(ValueError, match="tensor_parallel_size=1 rank leaves no other rank"):
        check_eplb(SimpleNamespace(num_local_experts=7), 1, True, ok.eplb_config)
    with pytest.raises(ValueError, match="the model has no experts to balance"):
        check_eplb(SimpleNamespace(), 2, True, ok.eplb_config)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """Mixtral with 7 experts: one redundant slot makes two ranks of 4."""
    folder = build_moe_model(tmp_path_factory.mktemp("mixtral7"), "mixtral", num_local_experts=7)
    return folder, hf_greedy(folder, _prompts(), MAX_NEW)


def _slot_weights(worker) -> dict[str, tuple[list[int], torch.Tensor, torch.Tensor]]:
    """On each rank: every balanced layer's slots (their logical experts) and stacked weights."""
    from tokenmill.eplb.rebalance import balanced_layers

    return {layer.prefix: (list(layer.placement.local_experts), layer.gate_up_proj.clone(), layer.down_proj.clone())
            for layer in balanced_layers(worker.runner.model)}


def test_rebalancing_mid_generation_keeps_the_tokens_of_transformers(mixtral):
    folder, expected = mixtral
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory="16MiB", max_num_batched_tokens=32,
              tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"num_redundant_experts": 1, "window_size": 4, "step_interval": 3})
    registry = CollectorRegistry()
    llm.engine.stat_loggers.append(ExpertLoadStatLogger(
        lambda: engine_expert_loads(llm.engine), "tiny", registry, interval_s=0.0,
        read_replicas=lambda: engine_expert_replicas(llm.engine)))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
        stats = llm.engine.core.executor.collective_rpc("eplb_stats")
        slots = llm.engine.core.executor.collective_rpc(_slot_weights)
        replicas = engine_expert_replicas(llm.engine)
    finally:
        llm.engine.shutdown()
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i}: greedy tokens differ from transformers"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i}: logprobs differ"
    # the placement changed while requests ran, alike on both ranks
    assert stats[0]["rebalances"] >= 1 and stats[0]["experts_moved"] > 0, stats[0]
    assert stats[0]["placements"] == stats[1]["placements"]
    checkpoint = load_file(str(folder / "model.safetensors"))
    for rank, layers in enumerate(slots):
        assert len(layers) == 2, "both Mixtral layers are balanced"
        for prefix, (experts, gate_up, down) in layers.items():
            assert experts == stats[0]["placements"][prefix][rank * 4:(rank + 1) * 4]
            for slot, e in enumerate(experts):  # the moved weights are the expert's own
                w1, w3, w2 = (checkpoint[f"{prefix}.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
                assert torch.equal(gate_up[slot], torch.cat([w1, w3])), (rank, prefix, slot, e)
                assert torch.equal(down[slot], w2), (rank, prefix, slot, e)
    for prefix, counts in replicas.items():
        assert sum(counts) == 8 and min(counts) == 1 and counts == _copies(stats[0]["placements"][prefix], 7)
    series = {(s.labels["layer"], int(s.labels["expert"])): s.value for metric in registry.collect()
              for s in metric.samples if s.name == "tokenmill:moe_expert_replicas"}
    assert series == {(prefix, e): float(c) for prefix, counts in replicas.items() for e, c in enumerate(counts)}
