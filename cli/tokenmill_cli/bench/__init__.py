"""``tokenmill bench``: throughput, latency and serving benchmarks, and the
transformers baseline on the same workload (see docs/benchmarks.md)."""
