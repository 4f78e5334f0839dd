"""Triton attention plugin: one paged-attention kernel for mixed prefill and decode
batches, and the KV-cache write kernel; the portable GPU backend (CUDA and ROCm).

Triton is imported only when the backend is built, so listing plugins stays cheap
and a machine without Triton simply never builds it.
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.plugin_api import AttentionBackendSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

# Torch addresses a ROCm (HIP) GPU as "cuda" too, and so does the ROCm platform: one entry, both.
GPU_DEVICE_TYPES = ("cuda",)
# Head sizes are padded to a power of two inside the kernel; multiples of 8 up to 256 keep
# the padding small and the tiles within the registers of one program.
HEAD_SIZES = tuple(range(16, 257, 8))
PRIORITY = 20  # above the SDPA reference (0) wherever both run; a platform may rank it otherwise


def interpreting() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@hookimpl
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec]:
    specs = [AttentionBackendSpec(
        name="triton",
        qualname="tokenmill_attn_triton.backend:TritonAttentionBackend",
        device_types=GPU_DEVICE_TYPES,
        dtypes=("float32", "bfloat16", "float16"),
        head_sizes=HEAD_SIZES,
        priority=PRIORITY,
        supports_logits_soft_cap=True,
    )]
    if interpreting():
        # Under the interpreter the same kernels run on the CPU, far too slowly to be chosen
        # unasked: offered below every other backend, for tests that name it.
        specs.append(AttentionBackendSpec(
            name="triton-interpreted",
            qualname="tokenmill_attn_triton.backend:TritonAttentionBackend",
            device_types=("cpu",),
            dtypes=("float32", "bfloat16", "float16"),
            head_sizes=HEAD_SIZES,
            priority=-100,
            supports_logits_soft_cap=True,
        ))
    return specs
