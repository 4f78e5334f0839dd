"""The ``kv_shared_storage`` KV connector end to end: a producer engine writes its prompts' KV
blocks to a folder, a consumer engine loads them instead of computing the prompts, and its
greedy output is transformers'. A damaged block file is detected and its prompt recomputed; as
an offload tier, a prefix evicted from the device cache comes back from the folder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

BLOCK = 16
LENGTHS = (20, 37, 50, 70)  # one block and a bit, up to four blocks and a bit
MAX_TOKENS = 6


class ScheduledTokens:
    """Counts the tokens an engine computed (a stat logger)."""

    def __init__(self) -> None:
        self.total = 0

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        self.total += iteration.num_scheduled_tokens


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]


def _engine(model: Path, folder: Path, role: str | None, counter: ScheduledTokens | None = None,
            **kwargs) -> LLM:
    transfer = None if role is None else {"kv_connector": "kv_shared_storage", "kv_role": role,
                                          "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return LLM(str(model), dtype="float32", max_model_len=128, block_size=BLOCK, kv_transfer_config=transfer,
               stat_loggers=[counter] if counter else [], **kwargs)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


def _loadable(n: int) -> int:
    """The prompt tokens a consumer can load: whole blocks, never the last token."""
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def expected(llama_path) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(llama_path, _prompts(), MAX_TOKENS)]


def test_consumer_loads_what_the_producer_wrote_and_computes_almost_nothing(llama_path, tmp_path, expected):
    producer = _engine(llama_path, tmp_path, "kv_producer", kv_cache_memory="8MiB")
    prompts = _prompts()
    assert _generate(producer, prompts) == expected  # a producer is a normal engine besides
    files = list(tmp_path.glob("*.kvb"))
    assert len(files) == sum(n // BLOCK for n in LENGTHS)  # every full prompt block (the outputs fill none)

    counter = ScheduledTokens()
    consumer = _engine(llama_path, tmp_path, "kv_consumer", counter, kv_cache_memory="8MiB")
    assert _generate(consumer, prompts) == expected
    stats = consumer.engine.scheduler_stats
    loaded = sum(_loadable(n) for n in LENGTHS)
    assert stats.prefix_cache_external_hits == loaded
    # computed: each prompt's tail after its loaded blocks (at most a block), then the decode steps
    assert counter.total == sum(LENGTHS) - loaded + len(LENGTHS) * (MAX_TOKENS - 1)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_waiting_for_remote_kvs == 0
    assert sorted(tmp_path.glob("*.kvb")) == sorted(files)  # a consumer writes nothing


def test_a_corrupt_or_truncated_block_is_refused_and_its_prompt_recomputed(llama_path, tmp_path, expected):
    prompts = _prompts()
    producer = _engine(llama_path, tmp_path, "kv_producer", kv_cache_memory="8MiB")
    files_of = []  # each prompt's block files, in the order they were written
    for prompt in prompts:
        before = set(tmp_path.glob("*.kvb"))
        _generate(producer, [prompt])
        files_of.append(set(tmp_path.glob("*.kvb")) - before)
    corrupt, truncated = min(files_of[0]), min(files_of[3])  # a block of the first prompt, one of the last
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0x01  # one bit of the payload
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])

    counter = ScheduledTokens()
    consumer = _engine(llama_path, tmp_path, "kv_consumer", counter, kv_cache_memory="8MiB")
    assert _generate(consumer, prompts) == expected
    stats = consumer.engine.scheduler_stats
    # the two damaged prompts were computed whole; the two others loaded
    assert stats.prefix_cache_external_hits == _loadable(LENGTHS[1]) + _loadable(LENGTHS[2])
    assert counter.total == (LENGTHS[0] + LENGTHS[3] + LENGTHS[1] - _loadable(LENGTHS[1])
                             + LENGTHS[2] - _loadable(LENGTHS[2]) + len(LENGTHS) * (MAX_TOKENS - 1))
    assert not corrupt.exists() and not truncated.exists()  # refused files are removed, not offered again
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_as_an_offload_tier_an_evicted_prefix_is_loaded_back(llama_path, tmp_path, expected):
    prompts = _prompts()
    counter = ScheduledTokens()
    # 8 blocks: the last prompt alone needs 5, so running the others evicts its blocks
    llm = _engine(llama_path, tmp_path, "kv_both", counter, num_kv_blocks=8)
    assert _generate(llm, [prompts[3]]) == [expected[3]]
    assert _generate(llm, prompts[:3]) == expected[:3]
    before = llm.engine.scheduler_stats
    counter.total = 0
    assert _generate(llm, [prompts[3]]) == [expected[3]]
    after = llm.engine.scheduler_stats
    device_hits = after.prefix_cache_hits - before.prefix_cache_hits
    external_hits = after.prefix_cache_external_hits - before.prefix_cache_external_hits
    assert device_hits < _loadable(LENGTHS[3])  # some of its blocks were evicted from the device cache...
    assert device_hits + external_hits == _loadable(LENGTHS[3])  # ...and came back from the folder
    assert counter.total == LENGTHS[3] - _loadable(LENGTHS[3]) + MAX_TOKENS - 1


def test_an_unknown_connector_or_a_parallel_layout_fails_the_start(llama_path):
    with pytest.raises(ValueError, match=r"unknown KV connector 'nope' \(known: .*kv_shared_storage"):
        LLM(str(llama_path), kv_transfer_config={"kv_connector": "nope"})
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LLM(str(llama_path), pipeline_parallel_size=2, kv_transfer_config={"kv_connector": "kv_shared_storage"})


def test_under_tensor_parallelism_each_rank_writes_and_loads_its_own_heads(llama_path, tmp_path, expected):
    """One engine of two ranks as its own offload tier (one engine start, not two): every rank writes
    its file of each block, and an evicted prefix comes back from both ranks' files."""
    prompts = _prompts()
    counter = ScheduledTokens()
    llm = _engine(llama_path, tmp_path, "kv_both", counter, num_kv_blocks=8, tensor_parallel_size=2)
    assert _generate(llm, prompts) == expected  # the last prompt's blocks are evicted by the ones after it
    num_blocks = sum(n // BLOCK for n in LENGTHS)
    assert len(list(tmp_path.glob("*.tp2.r0.kvb"))) == len(list(tmp_path.glob("*.tp2.r1.kvb"))) == num_blocks
    before = llm.engine.scheduler_stats
    counter.total = 0
    assert _generate(llm, [prompts[0]]) == [expected[0]]
    after = llm.engine.scheduler_stats
    device_hits = after.prefix_cache_hits - before.prefix_cache_hits
    external_hits = after.prefix_cache_external_hits - before.prefix_cache_external_hits
    assert external_hits > 0 and device_hits + external_hits == _loadable(LENGTHS[0])
    assert counter.total == LENGTHS[0] - _loadable(LENGTHS[0]) + MAX_TOKENS - 1
    llm.engine.shutdown()
