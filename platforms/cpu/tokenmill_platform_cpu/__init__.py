"""CPU platform plugin: always available, lowest priority; also offers the
``cpu-paged`` attention backend (a C++ kernel compiled on first use)."""

from typing import Any

from tokenmill.plugin_api import AttentionBackendSpec, PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec:
    return PlatformSpec(name="cpu", qualname="tokenmill_platform_cpu.platform:CpuPlatform", priority=0)


@hookimpl
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec]:
    # Preferred over SDPA on the CPU when its kernel builds; the engine falls back otherwise.
    return [
        AttentionBackendSpec(
            name="cpu-paged",
            qualname="tokenmill_platform_cpu.attention:CpuPagedAttentionBackend",
            device_types=("cpu",),
            dtypes=("float32", "bfloat16"),
            priority=10,
            kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),  # fp8: a torch path (attention.py)
        )
    ]
