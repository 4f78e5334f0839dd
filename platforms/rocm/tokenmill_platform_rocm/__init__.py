"""ROCm platform plugin: detected when torch is a HIP build (``torch.version.hip``) and sees
an AMD GPU. It steps aside with a log line otherwise; torch is imported inside the hook."""

from __future__ import annotations

import logging

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
logger = logging.getLogger(__name__)


def rocm_device_reason() -> str | None:
    """Why the ROCm platform cannot run here, or None when it can."""
    import torch

    if torch.version.hip is None:
        return "torch is not a ROCm (HIP) build"
    if not torch.cuda.is_available():
        return "torch sees no ROCm device"
    return None


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec | None:
    reason = rocm_device_reason()
    if reason is not None:
        logger.info("platform rocm is installed but steps aside: %s", reason)
        return None
    return PlatformSpec(name="rocm", qualname="tokenmill_platform_rocm.platform:RocmPlatform", priority=10,
                        device_type="cuda")
