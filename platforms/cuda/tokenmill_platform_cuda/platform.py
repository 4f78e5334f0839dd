"""The CUDA platform: one device per process, bfloat16 by default, a KV cache sized per
process from ``gpu_memory_utilization``, CUDA graphs for decode batches, and the device's
compute capability and attention priorities for the selectors (``KernelFeatures``), and the
Triton fused MoE as its layer op (``layer_ops.CudaLayerOps``) where triton is installed."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from tokenmill.layers import register_layer_ops
from tokenmill.plugin_api import EngineConfig, StepGraph
from tokenmill_platform_cuda import graphs
from tokenmill_platform_cuda.memory import ACTIVATION_MARGIN, baseline_free, kv_cache_budget, read_device_memory

logger = logging.getLogger(__name__)

# FlashAttention first where its compute capability and block size allow, then FlashInfer, then
# the portable Triton kernel; SDPA (the reference) last. Backends not named keep their own priority.
CUDA_ATTENTION_PRIORITIES: Mapping[str, int] = MappingProxyType(
    {"flash-attn": 40, "flashinfer": 30, "triton": 20, "sdpa": 0})


class CudaPlatform:
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def __init__(self, device_index: int | None = None) -> None:
        # a tensor-parallel rank's process is told its device by LOCAL_RANK (set by the mp executor)
        self.device_index = int(os.environ.get("LOCAL_RANK", 0)) if device_index is None else device_index

    def device_count(self) -> int:
        """One rank per GPU (NCCL runs no two ranks on one device)."""
        return torch.cuda.device_count()

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def configure_process(self, config: EngineConfig) -> None:
        torch.cuda.set_device(self.device_index)
        baseline_free(self.device_index)
        if importlib.util.find_spec("triton") is not None:  # the MoE experts in the Triton fused kernel
            from tokenmill_platform_cuda.layer_ops import CudaLayerOps

            register_layer_ops("cuda", CudaLayerOps())

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        """An explicit ``kv_cache_memory`` wins (as vLLM's ``kv_cache_memory_bytes``);
        otherwise this process's share (``gpu_memory_utilization`` of the device) less what
        it holds once its weights are in, counted per process (tokenmill_platform_cuda.memory)."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        memory = read_device_memory(self.device_index)
        budget = kv_cache_budget(memory, config.gpu_memory_utilization)
        logger.info("KV cache budget %.2f GiB: %.0f%% of %.2f GiB less %.2f GiB this process holds",
                    budget / (1 << 30), config.gpu_memory_utilization * 100, memory.total / (1 << 30),
                    (memory.torch_reserved + memory.non_torch) / (1 << 30))
        return budget

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)

    # -- ActivationProfiling: the largest step's peak, then the KV cache from what is left --

    def measure_peak_bytes(self, run: Callable[[], object]) -> int:
        """Peak bytes ``run`` allocated beyond what was allocated before; the allocator's cache
        is emptied afterwards, so that what it reserved for the step is not counted twice."""
        torch.cuda.synchronize(self.device_index)
        torch.cuda.reset_peak_memory_stats(self.device_index)
        before = torch.cuda.memory_allocated(self.device_index)
        run()
        torch.cuda.synchronize(self.device_index)
        peak = torch.cuda.max_memory_allocated(self.device_index) - before
        torch.cuda.empty_cache()
        logger.info("largest step's activations: %.1f MiB", peak / (1 << 20))
        return peak

    def kv_cache_bytes_after_profile(self, config: EngineConfig, activation_bytes: int) -> int:
        memory = read_device_memory(self.device_index)
        budget = kv_cache_budget(memory, config.gpu_memory_utilization, activation_bytes + ACTIVATION_MARGIN)
        logger.info("KV cache budget %.2f GiB: %.0f%% of %.2f GiB less %.2f GiB this process holds and "
                    "%.2f GiB for activations and graphs", budget / (1 << 30), config.gpu_memory_utilization * 100,
                    memory.total / (1 << 30), (memory.torch_reserved + memory.non_torch) / (1 << 30),
                    (activation_bytes + ACTIVATION_MARGIN) / (1 << 30))
        return budget

    # -- StepGraphCapture: CUDA graphs for decode batches (tokenmill_platform_cuda.graphs) --

    def new_graph_pool(self, max_batch_size: int) -> object:
        return graphs.new_graph_pool(self.device_index)

    def capture_step_graph(self, run: Callable[[], tuple[torch.Tensor, ...]], pool: object,
                           batch_size: int) -> tuple[StepGraph, tuple[torch.Tensor, ...]]:
        return graphs.capture_step_graph(run, pool, batch_size, self.device_index)

    # -- KernelFeatures: what the attention and quantization selectors are told --

    def compute_capability(self) -> tuple[int, int] | None:
        major, minor = torch.cuda.get_device_capability(self.device_index)
        return (major, minor)

    def attention_priorities(self) -> Mapping[str, int]:
        return CUDA_ATTENTION_PRIORITIES
