"""SDPA attention plugin: runs wherever torch runs, and is the reference that
every other backend is checked against."""

from typing import Any

from tokenmill.plugin_api import AttentionBackendSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="sdpa",
            qualname="tokenmill_attn_sdpa.backend:SDPABackend",
            device_types=("cpu", "cuda", "xpu"),
            priority=0,
            supports_logits_soft_cap=True,
            kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        )
    ]
