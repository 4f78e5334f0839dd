"""CPU platform plugin: always available, lowest priority."""

from tokenmill.hookspecs import hookimpl
from tokenmill.plugins.specs import PlatformSpec

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_detect_platform() -> PlatformSpec:
    return PlatformSpec(name="cpu", qualname="tokenmill_platform_cpu.platform:CpuPlatform", priority=0)
