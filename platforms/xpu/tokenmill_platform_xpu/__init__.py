"""Intel XPU platform plugin: detected when ``torch.xpu`` sees a device; steps aside with a
log line otherwise. torch is imported inside the hook; intel-extension-for-pytorch never
here (see :mod:`tokenmill_platform_xpu.ipex`)."""

from __future__ import annotations

import logging

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
logger = logging.getLogger(__name__)


def xpu_device_reason() -> str | None:
    """Why the XPU platform cannot run here, or None when it can."""
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return "this torch has no torch.xpu"
    if not xpu.is_available():
        return "torch sees no XPU device"
    return None


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec | None:
    reason = xpu_device_reason()
    if reason is not None:
        logger.info("platform xpu is installed but steps aside: %s", reason)
        return None
    return PlatformSpec(name="xpu", qualname="tokenmill_platform_xpu.platform:XpuPlatform", priority=10,
                        device_type="xpu")
