"""FlashAttention plugin: FlashAttention 2's ``flash_attn_varlen_func`` over the paged KV
cache (``block_table``), for NVIDIA GPUs of compute capability 8.0 and up.

The spec is static and imports nothing: ``flash_attn`` is imported when the backend is
built, so a machine without it (any CPU box: it only builds against a CUDA toolkit) passes
over this backend with the import error as the reason.
"""

from typing import Any

from tokenmill.plugin_api import AttentionBackendSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

# FlashAttention 2 rounds a head size up to its next kernel (32, 64, 96, 128, 160, 192, 224, 256):
# any multiple of 8 up to 256 runs.
FLASH_HEAD_SIZES = tuple(range(8, 257, 8))

FLASH_ATTN_SPEC = AttentionBackendSpec(
    name="flash-attn",
    qualname="tokenmill_attn_flash.backend:FlashAttentionBackend",
    device_types=("cuda",),
    platforms=("cuda",),  # the ROCm build of flash-attn is a different package
    dtypes=("float16", "bfloat16"),
    head_sizes=FLASH_HEAD_SIZES,
    supports_sliding_window=True,
    supports_logits_soft_cap=True,  # softcap= since flash-attn 2.6
    min_compute_capability=(8, 0),
    block_size_multiple=256,  # its paged path reads whole 256-token pages
    priority=40,
)


@hookimpl
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec]:
    return [FLASH_ATTN_SPEC]
