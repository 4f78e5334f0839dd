"""The KV-cache budget counted per process (tokenmill_platform_cuda.memory), from readings
given here; on a GPU (``-m gpu``) from the device itself, and with CUDA graphs captured."""

from __future__ import annotations

import pytest
import torch

from tokenmill_platform_cuda.memory import DeviceMemory, GiB, kv_cache_budget


def test_a_second_engine_does_not_count_the_first_ones_memory():
    """Two engines at 0.45 on an 80 GiB card: the second sees the first's 36 GiB as used by
    another process, yet gets the same budget, since its own share is counted from its own holdings."""
    first = DeviceMemory(total=80 * GiB, free=78 * GiB, torch_reserved=2 * GiB, non_torch=0)
    alone = kv_cache_budget(first, 0.45, activation_bytes=0)
    second = DeviceMemory(total=80 * GiB, free=78 * GiB - 36 * GiB, torch_reserved=2 * GiB, non_torch=0)
    assert kv_cache_budget(second, 0.45, activation_bytes=0) == alone == int(80 * GiB * 0.45) - 2 * GiB


def test_the_process_holdings_and_the_activation_margin_come_off_its_share():
    memory = DeviceMemory(total=10 * GiB, free=9 * GiB, torch_reserved=GiB // 2, non_torch=GiB // 4)
    assert kv_cache_budget(memory, 0.5, activation_bytes=GiB // 4) == 5 * GiB - GiB


def test_a_share_the_weights_already_fill_is_refused():
    memory = DeviceMemory(total=10 * GiB, free=4 * GiB, torch_reserved=6 * GiB, non_torch=0)
    with pytest.raises(RuntimeError, match=r"holds 6\.00 GiB of its 5\.00 GiB share"):
        kv_cache_budget(memory, 0.5)


def test_a_budget_other_processes_leave_no_room_for_names_them():
    memory = DeviceMemory(total=10 * GiB, free=2 * GiB, torch_reserved=GiB, non_torch=0)
    with pytest.raises(RuntimeError, match=r"other processes hold 7\.00 GiB"):
        kv_cache_budget(memory, 0.9, activation_bytes=0)


def test_the_cuda_platform_reports_its_kernel_features_and_graphs():
    from tokenmill.platform import KernelFeatures, StepGraphCapture
    from tokenmill_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform(device_index=0)
    assert isinstance(platform, KernelFeatures) and isinstance(platform, StepGraphCapture)
    assert max(platform.attention_priorities().items(), key=lambda item: item[1])[0] == "flash-attn"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_device_budget_follows_the_utilisation():
    from tokenmill_platform_cuda.memory import baseline_free, read_device_memory

    baseline_free(0)
    memory = read_device_memory(0)
    low, high = kv_cache_budget(memory, 0.3), kv_cache_budget(memory, 0.6)
    assert high - low == int(memory.total * 0.6) - int(memory.total * 0.3)


@pytest.mark.gpu
@gpu
def test_a_captured_graph_replays_new_inputs():
    from tokenmill_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform(device_index=0)
    x = torch.ones(8, device="cuda")
    weight = torch.arange(8.0, device="cuda")
    graph, (out,) = platform.capture_step_graph(lambda: (x * weight + 1,), platform.new_graph_pool(8), 8)
    assert out.tolist() == (weight + 1).tolist()  # the capture step's own result
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == (2 * weight + 1).tolist()


@pytest.mark.gpu
@gpu
def test_the_profiled_peak_counts_what_the_step_allocated():
    from tokenmill_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform(device_index=0)
    size = 64 << 20

    def step() -> None:
        scratch = torch.empty(size, dtype=torch.uint8, device="cuda")
        scratch.fill_(1)

    assert platform.measure_peak_bytes(step) >= size
