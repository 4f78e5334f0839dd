"""CUDA platform plugin: detected when torch sees a CUDA device.

Detection imports torch inside the hook (not at module import), so listing
plugins stays cheap.
"""

from __future__ import annotations

import logging

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
logger = logging.getLogger(__name__)


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec | None:
    import torch

    if torch.version.hip is not None:
        return None  # a ROCm build: the rocm platform's
    if not torch.cuda.is_available():
        logger.info("platform cuda is installed but steps aside: torch sees no CUDA device")
        return None
    return PlatformSpec(name="cuda", qualname="tokenmill_platform_cuda.platform:CudaPlatform",
                        priority=10, device_type="cuda")
