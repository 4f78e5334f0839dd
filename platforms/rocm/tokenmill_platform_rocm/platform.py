"""The ROCm platform: HIP devices through ``torch.cuda`` (the CUDA platform's device and
memory handling, which torch maps to HIP), RCCL through torch.distributed's ``nccl``
backend, and the Triton attention kernel as the default backend. AMD's compute
capabilities are not NVIDIA's numbers, so none is reported: backends that need one
(FlashAttention 2's CUDA build, FlashInfer) are passed over."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tokenmill_platform_cuda.platform import CudaPlatform

# Triton is the portable GPU kernel and the default here; SDPA is the reference.
ROCM_ATTENTION_PRIORITIES: Mapping[str, int] = MappingProxyType({"triton": 30, "sdpa": 0})


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"  # torch addresses HIP devices as "cuda"
    dist_backend = "nccl"  # RCCL answers to torch.distributed's nccl backend on ROCm

    def compute_capability(self) -> tuple[int, int] | None:
        return None

    def attention_priorities(self) -> Mapping[str, int]:
        return ROCM_ATTENTION_PRIORITIES
