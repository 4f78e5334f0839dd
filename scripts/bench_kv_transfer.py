"""``python scripts/bench_kv_transfer.py MODEL MIX.jsonl``: per-request KV transfer cost of a
2k-token prompt (float32, one thread): the time a consumer takes to load the prompt's KV and
sample one token, next to computing the prompt (docs/benchmarks.md)."""
import json
import shutil
import statistics
import sys
import tempfile
import time

from tokenmill import LLM, SamplingParams

STORE = tempfile.mkdtemp(prefix="kv-store-")
M = sys.argv[1]  # a random-model folder with 4096 positions
rows = [json.loads(line) for line in open(sys.argv[2])]
longs = [r["prompt"] for r in rows if r["output_len"] == 16][:4]
one = SamplingParams(temperature=0, max_tokens=1)


def llm(transfer=None):
    return LLM(M, dtype="float32", max_model_len=4096, kv_cache_memory="768MiB", kv_transfer_config=transfer,
               enable_prefix_caching=True)


def timed(engine, prompt):
    start = time.perf_counter()
    out = engine.generate([prompt], one)
    return time.perf_counter() - start, out


plain = llm()
timed(plain, "warm up")
compute = [timed(plain, p)[0] for p in longs]
n_tokens = [len(plain.get_tokenizer().encode(p)) for p in longs]
per_block = plain.engine.core.executor.kv_bytes_per_block()
mb = [(n - 1) // 16 * per_block / 1e6 for n in n_tokens]
del plain
print(f"prompt tokens {n_tokens}; KV loaded per prompt {statistics.mean(mb):.1f} MB; compute whole prompt "
      f"{statistics.median(compute)*1000:.0f} ms (median of {len(compute)})")
shutil.rmtree(STORE, ignore_errors=True)
for name, prod, cons in [
    ("kv_shared_storage", {"shared_storage_path": STORE}, {"shared_storage_path": STORE}),
    ("kv_zmq", {"bind": "tcp://127.0.0.1:8391"}, {"peers": ["tcp://127.0.0.1:8391"]}),
]:
    producer = llm({"kv_connector": name, "kv_role": "kv_producer", "kv_connector_extra_config": prod})
    consumer = llm({"kv_connector": name, "kv_role": "kv_consumer", "kv_connector_extra_config": cons})
    timed(consumer, "warm up")
    times = []
    for p in longs:
        timed(producer, p)
        times.append(timed(consumer, p)[0])
    hits = consumer.engine.scheduler_stats.prefix_cache_external_hits
    print(f"{name}: load + sample one token {statistics.median(times)*1000:.0f} ms (median of {len(times)}; "
          f"{hits} prompt tokens loaded)")
    worker = consumer.engine.core.executor.collective_rpc(lambda w: w.runner.kv_connector, ())[0]
    if hasattr(worker, "seconds_fetching") and worker.num_fetched:  # kv_zmq: the fetch alone, ask to last layer in
        print(f"{name}: fetch {worker.seconds_fetching / worker.num_fetched * 1000:.0f} ms, "
              f"{worker.bytes_fetched / worker.num_fetched / 1e6:.1f} MB per request (mean of {worker.num_fetched})")
    consumer.engine.shutdown()
    producer.engine.shutdown()
