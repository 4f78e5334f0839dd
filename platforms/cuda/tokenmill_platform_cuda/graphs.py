"""CUDA graphs for decode steps (the core's ``StepGraphCapture`` seam, tokenmill.worker.step_graphs).

A capture records the kernels of one forward without running them, so ``run`` first
runs once eagerly on a side stream (lazy initialisations — cuBLAS handles, Triton's
compilation and autotuning — must not happen inside a capture), is then captured into the
runner's shared memory pool, and the graph is replayed once so that its output tensors
hold this step's results (the capture is a real step of the engine). A forward that
synchronises with the host, or calls something capture forbids, raises inside the
capture: that batch size then runs eagerly. Each capture's time is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from tokenmill.plugin_api import StepGraphUnsupported

logger = logging.getLogger(__name__)


def new_graph_pool(device_index: int) -> object:
    with torch.cuda.device(device_index):
        return torch.cuda.graph_pool_handle()


def capture_step_graph(run: Callable[[], tuple[torch.Tensor, ...]], pool: object, batch_size: int,
                       device_index: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    start = time.perf_counter()
    side = torch.cuda.Stream(device_index)
    side.wait_stream(torch.cuda.current_stream(device_index))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device_index).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=cast(Any, pool)):
            outputs = run()
    except RuntimeError as exc:
        torch.cuda.synchronize(device_index)
        raise StepGraphUnsupported(f"CUDA graph capture failed: {exc}") from exc
    graph.replay()
    logger.info("decode batch %d captured as a CUDA graph in %.1f ms", batch_size,
                (time.perf_counter() - start) * 1000)
    return graph, outputs
