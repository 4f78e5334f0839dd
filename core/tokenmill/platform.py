"""The platform interface and how the engine picks one.

Each platform plugin answers ``tokenmill_detect_platform`` when its device is
present; the available platform of highest priority wins. A platform object is
small: a device, a default dtype, a KV-cache budget, a thread set-up and the
torch.distributed backend name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.errors import PluginError
from tokenmill.plugins.specs import resolve_qualname

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.plugins.manager import PluginManager


class Platform(Protocol):
    name: str
    device_type: str
    dist_backend: str

    def device(self) -> torch.device: ...

    def default_dtype(self) -> torch.dtype: ...

    def configure_process(self, config: EngineConfig) -> None:
        """Per-process set-up before the model is built (threads, device selection)."""
        ...

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        """Bytes the KV cache may take, called after the model's weights are loaded."""
        ...

    def synchronize(self) -> None: ...


def detect_platform(plugins: PluginManager) -> Platform:
    """Instantiate the available platform of highest priority."""
    found = [r.value for r in plugins.collect("tokenmill_detect_platform")]
    if not found:
        raise PluginError("no platform plugin found; install tokenmill-platform-cpu (pip install tokenmill)")
    best = max(found, key=lambda spec: spec.priority)
    return resolve_qualname(best.qualname)()


def resolve_dtype(config_dtype: str, platform: Platform) -> torch.dtype:
    """``auto`` means the platform's default; anything else is taken literally."""
    if config_dtype == "auto":
        return platform.default_dtype()
    return getattr(torch, config_dtype)
