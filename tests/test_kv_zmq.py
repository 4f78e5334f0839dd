"""The ``kv_zmq`` KV connector end to end, over real ZeroMQ sockets on 127.0.0.1: a consumer
engine fetches a producer engine's prompt KV, layer by layer, and its greedy output is transformers'; a dead or
silent producer, a corrupt or truncated payload, or a consumer that goes away never hang or
poison anything: the consumer computes the prompt, the producer frees its blocks after a lease."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from test_kv_shared_storage import ScheduledTokens
from tiny_models import hf_greedy
from worker_probe import on_rank_zero

from tokenmill import LLM, SamplingParams
from tokenmill.request import RequestStatus

BLOCK = 16
LENGTHS = (20, 37, 50, 70)
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _free_endpoint() -> str:
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]


def _loadable(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


def _engine(model: Path, role: str, counter: ScheduledTokens | None = None, tensor_parallel_size: int = 1,
            **extra) -> LLM:
    transfer = {"kv_connector": "kv_zmq", "kv_role": role, "kv_connector_extra_config": extra}
    return LLM(str(model), dtype="float32", max_model_len=128, block_size=BLOCK, kv_cache_memory="8MiB",
               kv_transfer_config=transfer, stat_loggers=[counter] if counter else [],
               tensor_parallel_size=tensor_parallel_size)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _prefill(producer: LLM, prompts: list[list[int]]) -> None:
    """What the router sends a prefill server: one token per prompt."""
    _generate(producer, prompts, SamplingParams(temperature=0.0, max_tokens=1))


def _free_blocks(llm: LLM) -> tuple[int, int]:
    kv = llm.engine.core.kv_manager
    return kv.num_free_blocks, kv.num_blocks


def _worker_counter(llm: LLM, name: str) -> int:
    return on_rank_zero(llm, lambda worker: getattr(worker.runner.kv_connector, name))


def _num_layers(llm: LLM) -> int:
    return on_rank_zero(llm, lambda worker: len(worker.runner.kv_caches))


@pytest.fixture(scope="module")
def expected(llama_path) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(llama_path, _prompts(), MAX_TOKENS)]


@pytest.fixture(scope="module")
def producer(llama_path):
    endpoint = _free_endpoint()
    llm = _engine(llama_path, "kv_producer", bind=endpoint, lease_s=60)
    llm.endpoint = endpoint
    yield llm
    llm.engine.shutdown()


def test_the_consumer_fetches_the_producers_prompt_kv_and_the_producer_then_frees_it(llama_path, producer, expected):
    prompts = _prompts()
    _prefill(producer, prompts)
    free, total = _free_blocks(producer)
    assert free == total - sum(-(-n // BLOCK) for n in LENGTHS)  # every prompt's blocks kept, for a consumer
    counter = ScheduledTokens()
    consumer = _engine(llama_path, "kv_consumer", counter, peers=[producer.endpoint], fetch_timeout_s=10)
    assert _generate(consumer, prompts) == expected
    stats = consumer.engine.scheduler_stats
    assert stats.prefix_cache_external_hits == sum(_loadable(n) for n in LENGTHS)
    assert counter.total == sum(n - _loadable(n) for n in LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
    assert _worker_counter(consumer, "num_fetched") == len(LENGTHS)
    producer.engine.step()  # an idle step (a server's engine loop takes them) reports what was sent
    assert _free_blocks(producer) == (total, total)
    consumer.engine.shutdown()


def test_a_producer_frees_blocks_nobody_fetches_when_their_lease_ends(llama_path):
    endpoint = _free_endpoint()
    llm = _engine(llama_path, "kv_producer", bind=endpoint, lease_s=0.5)
    _prefill(llm, _prompts(1))
    free, total = _free_blocks(llm)
    assert free < total
    llm.engine.step()
    assert _free_blocks(llm)[0] == free  # the lease runs
    time.sleep(0.6)
    llm.engine.step()
    assert _free_blocks(llm) == (total, total)
    llm.engine.shutdown()


def test_a_dead_or_silent_producer_costs_a_recompute_not_a_hang(llama_path, expected):
    nobody = _free_endpoint()  # nothing listens there
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the fetch, never answers
    silent_endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        counter = ScheduledTokens()
        consumer = _engine(llama_path, "kv_consumer", counter, peers=[nobody, silent_endpoint], fetch_timeout_s=0.5)
        assert _generate(consumer, _prompts()) == expected
        assert consumer.engine.scheduler_stats.prefix_cache_external_hits == 0
        assert counter.total == sum(LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)  # every prompt computed here
        assert _worker_counter(consumer, "num_failed_fetches") == len(LENGTHS)
        assert silent.poll(0)  # the fetches did reach it
        consumer.engine.shutdown()
    finally:
        silent.close(linger=0)


class RelayingProxy(threading.Thread):
    """Relays fetches to a real producer and its answers back, message by message (one upstream
    socket per consumer socket): it may damage the last layer's payload on the way back
    (``damage``), or hold back layer ``hold_from`` and those after it (-1: the header too) until
    ``release`` is set."""

    def __init__(self, upstream: str, damage=None, hold_from: int | None = None) -> None:
        super().__init__(daemon=True)
        context = zmq.Context.instance()
        self.front = context.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.upstream = upstream
        self.damage = damage
        self.hold_from = hold_from
        self.release = threading.Event()
        self.first_layer_relayed = threading.Event()
        self.num_damaged = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        context = zmq.Context.instance()
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        backs: dict[bytes, zmq.Socket] = {}  # consumer socket -> its upstream socket
        consumer_of: dict[zmq.Socket, bytes] = {}
        num_layers = 0
        held: list[list[bytes]] = []
        while not self._stop_event.is_set():
            if self.release.is_set() and held:
                for message in held:
                    self.front.send_multipart(message)
                held.clear()
            for sock, _event in poller.poll(50):
                if sock is self.front:
                    identity, *message = self.front.recv_multipart()
                    if identity not in backs:
                        back = backs[identity] = context.socket(zmq.DEALER)
                        back.connect(self.upstream)
                        consumer_of[back] = identity
                        poller.register(back, zmq.POLLIN)
                    backs[identity].send_multipart(message)
                    continue
                reply = sock.recv_multipart()
                if reply[0] == b"KV":
                    num_layers = len(json.loads(reply[1])["layout"])
                layer = json.loads(reply[1])["layer"] if reply[0] == b"LAYER" else -1 if reply[0] == b"KV" else None
                if self.damage is not None and layer == num_layers - 1:
                    reply = self.damage(reply)
                    self.num_damaged += 1
                message = [consumer_of[sock], *reply]
                held_back = self.hold_from is not None and layer is not None and layer >= self.hold_from
                if held_back and not self.release.is_set():
                    held.append(message)
                    continue
                for earlier in held:  # released meanwhile: what was held goes first, in order
                    self.front.send_multipart(earlier)
                held.clear()
                self.front.send_multipart(message)
                if layer == 0:
                    self.first_layer_relayed.set()
        for back in backs.values():
            back.close(linger=0)
        self.front.close(linger=0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def _flip_a_bit(reply: list[bytes]) -> list[bytes]:
    frame = bytearray(reply[-1])
    frame[len(frame) // 2] ^= 0x04
    return [*reply[:-1], bytes(frame)]


def _truncate(reply: list[bytes]) -> list[bytes]:
    return [*reply[:-1], reply[-1][:-8]]


def _drop_a_frame(reply: list[bytes]) -> list[bytes]:
    return reply[:-1]


@pytest.mark.parametrize("damage", [_flip_a_bit, _truncate, _drop_a_frame])
def test_a_damaged_layer_is_refused_and_the_prompt_recomputed(llama_path, producer, expected, damage):
    """The last layer is damaged: the earlier ones are in the blocks by then, and must not be used."""
    prompts = _prompts()
    _prefill(producer, prompts)
    proxy = RelayingProxy(producer.endpoint, damage)
    proxy.start()
    try:
        counter = ScheduledTokens()
        consumer = _engine(llama_path, "kv_consumer", counter, peers=[proxy.endpoint], fetch_timeout_s=10)
        assert _generate(consumer, prompts) == expected
        assert proxy.num_damaged == len(LENGTHS)
        assert _worker_counter(consumer, "num_layers_loaded") == len(LENGTHS) * (_num_layers(consumer) - 1)
        assert consumer.engine.scheduler_stats.prefix_cache_external_hits == 0
        assert counter.total == sum(LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
        consumer.engine.shutdown()
    finally:
        proxy.stop()


def _wait_until(condition, step=None, limit_s: float = 60.0) -> None:
    """Step (if given) until ``condition()``; a failure, not a hang, if it never comes."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        if step is not None:
            step()
        else:
            time.sleep(0.01)


def test_each_layer_is_copied_in_as_it_arrives_and_the_request_runs_once_all_are(llama_path, producer, expected):
    """The producer's layers after the first are held back: the first is in the consumer's blocks
    (equal to the producer's) while the request still waits; released, the output is a colocated run's."""
    prompt, want = _prompts()[3], expected[3]
    asked = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    (answer,) = [o.kv_transfer_params for o in producer.generate([{"prompt_token_ids": prompt}], asked)]
    proxy = RelayingProxy(producer.endpoint, hold_from=1)
    proxy.start()
    host, port = proxy.endpoint.removeprefix("tcp://").rsplit(":", 1)
    consumer = _engine(llama_path, "kv_consumer", fetch_timeout_s=120)
    try:
        engine = consumer.engine
        engine.add_request("r", {"prompt_token_ids": prompt},
                           _with_params({**answer, "remote_host": host, "remote_port": int(port)}))
        _wait_until(lambda: _worker_counter(consumer, "num_layers_loaded") >= 1, engine.step)
        assert proxy.first_layer_relayed.is_set()
        assert engine.core.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert _worker_counter(consumer, "num_layers_loaded") == 1  # the others are held back
        loaded = _loadable(len(prompt)) // BLOCK
        mine = engine.core.kv_manager.get_block_ids("r")[:loaded]
        theirs = answer["remote_block_ids"][:loaded]
        first_layer = on_rank_zero(consumer, lambda worker: worker.runner.kv_caches[0][0][mine].clone())
        assert torch.equal(first_layer, on_rank_zero(producer, lambda worker: worker.runner.kv_caches[0][0][theirs]))
        proxy.release.set()
        outputs = []
        _wait_until(lambda: outputs and outputs[-1].finished, lambda: outputs.extend(engine.step()))
        assert list(outputs[-1].outputs[0].token_ids) == want
        assert _worker_counter(consumer, "num_layers_loaded") == _num_layers(consumer)
        assert consumer.engine.scheduler_stats.prefix_cache_external_hits == _loadable(len(prompt))
    finally:
        consumer.engine.shutdown()
        proxy.stop()


def test_a_request_aborted_while_fetching_gives_its_blocks_back_at_once(llama_path):
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        consumer = _engine(llama_path, "kv_consumer", peers=[endpoint], fetch_timeout_s=600)
        engine = consumer.engine
        engine.add_request("r", {"prompt_token_ids": _prompts()[3]}, GREEDY)
        engine.step()
        engine.step()
        assert engine.core.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        engine.abort_request("r")
        engine.step()  # tells the worker: the fetch is cancelled, its blocks written no more
        assert _free_blocks(consumer)[0] == _free_blocks(consumer)[1]
        assert not engine.has_unfinished_requests()
        started = time.monotonic()
        engine.shutdown()  # the cancelled fetch does not hold the shutdown for its 600 s
        assert time.monotonic() - started < 60
    finally:
        silent.close(linger=0)


def _with_params(params: dict) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args={"kv_transfer_params": params})


def test_a_consumer_with_no_peers_fetches_from_the_producer_its_kv_transfer_params_name(llama_path, producer,
                                                                                         expected):
    prompts = _prompts()
    asked = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    answers = [o.kv_transfer_params for o in producer.generate([{"prompt_token_ids": p} for p in prompts], asked)]
    host, port = producer.endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert all(a["do_remote_prefill"] is True and (a["remote_host"], a["remote_port"]) == (host, int(port))
               for a in answers), answers
    assert [len(a["remote_block_ids"]) for a in answers] == [n // BLOCK for n in LENGTHS]  # the kept prompt blocks
    counter = ScheduledTokens()
    consumer = _engine(llama_path, "kv_consumer", counter, fetch_timeout_s=10)  # knows no producer itself
    outputs = [consumer.generate([{"prompt_token_ids": p}], _with_params(a))[0] for p, a in zip(prompts, answers, strict=True)]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert consumer.engine.scheduler_stats.prefix_cache_external_hits == sum(_loadable(n) for n in LENGTHS)
    assert counter.total == sum(n - _loadable(n) for n in LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
    assert _generate(consumer, [_prompts(5)[2]]) and _worker_counter(consumer, "num_fetched") == len(LENGTHS)
    assert all(o.kv_transfer_params is None for o in outputs)  # a consumer has nothing to answer
    producer.engine.step()
    free, total = _free_blocks(producer)
    assert free == total  # each request named in a fetch was freed once sent
    consumer.engine.shutdown()


def test_params_naming_a_refusing_producer_or_no_prefill_cost_a_recompute_at_once(llama_path, expected):
    nobody = _free_endpoint().removeprefix("tcp://").rsplit(":", 1)  # nothing listens there
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # a configured peer that would take a fetch, never answer
    silent_endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        counter = ScheduledTokens()
        consumer = _engine(llama_path, "kv_consumer", counter, peers=[silent_endpoint], fetch_timeout_s=120)
        refused = {"do_remote_prefill": True, "remote_host": nobody[0], "remote_port": int(nobody[1])}
        prompts = _prompts()
        started = time.monotonic()
        got = [list(consumer.generate([{"prompt_token_ids": p}], _with_params(params))[0].outputs[0].token_ids)
               for p, params in zip(prompts, [refused, {"do_remote_prefill": False}] * 2, strict=True)]
        assert time.monotonic() - started < 60  # the refusal is seen at once, not at the 120 s deadline
        assert got == expected
        assert consumer.engine.scheduler_stats.prefix_cache_external_hits == 0
        assert counter.total == sum(LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
        assert _worker_counter(consumer, "num_failed_fetches") == 2  # the refused ones; the others asked nobody
        assert not silent.poll(0)  # named params are not sent to the configured peers
        consumer.engine.shutdown()
    finally:
        silent.close(linger=0)


def test_a_producer_frees_at_once_what_do_remote_decode_false_says_nobody_fetches(llama_path):
    llm = _engine(llama_path, "kv_producer", bind=_free_endpoint(), lease_s=600)
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": False}})
    (output,) = llm.generate([{"prompt_token_ids": _prompts()[3]}], params)
    assert output.kv_transfer_params is None
    assert _free_blocks(llm)[0] == _free_blocks(llm)[1]
    llm.engine.shutdown()



def _tp_endpoint() -> str:
    """A base port whose next one is free too (rank 1 serves there)."""
    while True:
        base = _free_endpoint()
        host, port = base.removeprefix("tcp://").rsplit(":", 1)
        with zmq.Context.instance().socket(zmq.ROUTER) as probe:
            try:
                probe.bind(f"tcp://{host}:{int(port) + 1}")
            except zmq.ZMQError:
                continue
        return base


def test_under_tensor_parallelism_each_rank_fetches_its_own_heads_from_its_producer_rank(llama_path, expected):
    prompts = _prompts()
    producer = _engine(llama_path, "kv_producer", bind=_tp_endpoint(), lease_s=60, tensor_parallel_size=2)
    asked = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    answers = [o.kv_transfer_params for o in producer.generate([{"prompt_token_ids": p} for p in prompts], asked)]
    counter = ScheduledTokens()
    consumer = _engine(llama_path, "kv_consumer", counter, fetch_timeout_s=10, tensor_parallel_size=2)
    got = [list(consumer.generate([{"prompt_token_ids": p}], _with_params(a))[0].outputs[0].token_ids)
           for p, a in zip(prompts, answers, strict=True)]
    assert got == expected
    assert consumer.engine.scheduler_stats.prefix_cache_external_hits == sum(_loadable(n) for n in LENGTHS)
    assert counter.total == sum(n - _loadable(n) for n in LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
    deadline = time.monotonic() + 10
    while _free_blocks(producer)[0] < _free_blocks(producer)[1] and time.monotonic() < deadline:
        producer.engine.step()  # freed once both ranks sent their slice
    assert _free_blocks(producer)[0] == _free_blocks(producer)[1]
    consumer.engine.shutdown()
    producer.engine.shutdown()


def test_a_peer_whose_answer_breaks_midway_gives_way_to_the_next_ones_whole_answer(llama_path, producer, expected):
    """The first answer's last layer is damaged after its other layers were copied in; the second
    peer's answer (held back until then) is loaded from its first layer: no recompute."""
    prompts = _prompts()[2:3]
    _prefill(producer, prompts)
    damaged = RelayingProxy(producer.endpoint, _flip_a_bit)
    late = RelayingProxy(producer.endpoint, hold_from=-1)
    damaged.start()
    late.start()
    consumer = _engine(llama_path, "kv_consumer", peers=[damaged.endpoint, late.endpoint], fetch_timeout_s=120)
    try:
        engine = consumer.engine
        engine.add_request("r", {"prompt_token_ids": prompts[0]}, GREEDY)
        _wait_until(lambda: damaged.num_damaged == 1, engine.step)
        late.release.set()
        outputs = []
        _wait_until(lambda: outputs and outputs[-1].finished, lambda: outputs.extend(engine.step()))
        assert list(outputs[-1].outputs[0].token_ids) == expected[2]
        assert consumer.engine.scheduler_stats.prefix_cache_external_hits == _loadable(LENGTHS[2])
        layers = _num_layers(consumer)
        assert _worker_counter(consumer, "num_layers_loaded") == (layers - 1) + layers
        assert (_worker_counter(consumer, "num_fetched"), _worker_counter(consumer, "num_failed_fetches")) == (1, 0)
    finally:
        consumer.engine.shutdown()
        damaged.stop()
        late.stop()
