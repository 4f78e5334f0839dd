"""intel-extension-for-pytorch, only when it was built for this torch.

IPEX pins the torch it was built against; importing a mismatched one crashes the process
(torch 2.13 with an older IPEX does, here), so the version is read from the installed
distribution's metadata first and the module is imported only when its ``major.minor``
matches torch's. Without it the platform uses torch's native XPU operators.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata
from types import ModuleType

logger = logging.getLogger(__name__)

DISTRIBUTION = "intel-extension-for-pytorch"


def release(version: str) -> tuple[int, ...]:
    """``"2.13.0+xpu"`` -> ``(2, 13)``: the part IPEX and torch must share."""
    public = version.split("+", 1)[0]
    return tuple(int(part) for part in public.split(".")[:2] if part.isdigit())


def matching_ipex_version(torch_version: str) -> str | None:
    """The installed IPEX's version when it matches ``torch_version``, else None (logged)."""
    try:
        installed = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    if release(installed) != release(torch_version):
        logger.info("%s %s does not match torch %s: using torch's native XPU ops", DISTRIBUTION, installed,
                    torch_version)
        return None
    return installed


@functools.cache
def load_ipex() -> ModuleType | None:
    import torch

    if matching_ipex_version(torch.__version__) is None:
        return None
    import intel_extension_for_pytorch as ipex  # type: ignore[import-not-found]

    module: ModuleType = ipex
    return module
