"""CUDA platform plugin: detected when torch sees a CUDA device.

Detection imports torch inside the hook (not at module import), so listing
plugins stays cheap.
"""

from __future__ import annotations

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec | None:
    import torch

    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    return PlatformSpec(name="cuda", qualname="tokenmill_platform_cuda.platform:CudaPlatform",
                        priority=10, device_type="cuda")
