"""FlashInfer plugin: FlashInfer's paged prefill and decode wrappers, planned once per
step from tokenmill's metadata, for NVIDIA GPUs of compute capability 7.5 and up.

The spec is static; ``flashinfer`` is imported when the backend is built (it imports
without a GPU, but the backend refuses to build off CUDA, so a CPU box passes over it)."""

from typing import Any

from tokenmill.plugin_api import AttentionBackendSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

FLASHINFER_SPEC = AttentionBackendSpec(
    name="flashinfer",
    qualname="tokenmill_attn_flashinfer.backend:FlashInferBackend",
    device_types=("cuda",),
    platforms=("cuda",),
    dtypes=("float16", "bfloat16"),
    head_sizes=(64, 128, 256),  # the head sizes its prebuilt and JIT kernels are instantiated for
    supports_sliding_window=True,  # window_left
    supports_logits_soft_cap=True,  # logits_soft_cap
    min_compute_capability=(7, 5),
    priority=30,
)


@hookimpl
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec]:
    return [FLASHINFER_SPEC]
