"""Which attention backend runs: every registered spec ranked for this device and model.

A backend is ranked by its priority on this platform (the platform's
``attention_priorities``, else the spec's own ``priority``) and checked against what
the model and the device need (:func:`unsupported_reason`); the engine then builds the
first runnable one, falling down the list when one cannot import or build, and logs
which it took and why each one above it was passed over. The ranking is a pure
function of the specs and a :class:`DeviceDescription`, so it is tested against fake
devices (a V100, an H100, a ROCm card) on a machine that has none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.errors import PluginError
from tokenmill.plugins.specs import AttentionBackendSpec

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionBackend, AttentionRequirements

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceDescription:
    """What attention selection knows of the device: the platform's name (``cuda``, ``rocm``,
    ``xpu``, ``cpu``), torch's device type (``cuda`` on ROCm too), the NVIDIA compute
    capability (None elsewhere) and the platform's backend priorities."""

    platform: str
    device_type: str
    compute_capability: tuple[int, int] | None = None
    attention_priorities: Mapping[str, int] = field(default_factory=dict)

    def priority_of(self, spec: AttentionBackendSpec) -> int:
        return self.attention_priorities.get(spec.name, spec.priority)


def describe_device(platform: Any) -> DeviceDescription:
    """The description of a platform object; its optional :class:`~tokenmill.platform.KernelFeatures`
    give the compute capability and priorities."""
    from tokenmill.platform import KernelFeatures

    name, device_type = str(platform.name), str(platform.device_type)
    if isinstance(platform, KernelFeatures):
        return DeviceDescription(name, device_type, platform.compute_capability(),
                                 dict(platform.attention_priorities()))
    return DeviceDescription(name, device_type)


def _capability(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _device_reason(spec: AttentionBackendSpec, device: DeviceDescription) -> str | None:
    if device.device_type not in spec.device_types:
        return f"runs on {'/'.join(spec.device_types)}, not {device.device_type}"
    if spec.platforms is not None and device.platform not in spec.platforms:
        return f"runs on the {'/'.join(spec.platforms)} platform, not {device.platform}"
    low, high = spec.min_compute_capability, spec.max_compute_capability
    if low is None and high is None:
        return None
    cc = device.compute_capability
    if cc is None:
        return "needs an NVIDIA compute capability, the device reports none"
    if low is not None and cc < low:
        return f"needs compute capability >= {_capability(low)}, the device has {_capability(cc)}"
    if high is not None and cc > high:
        return f"needs compute capability <= {_capability(high)}, the device has {_capability(cc)}"
    return None


def _model_reason(spec: AttentionBackendSpec, needs: AttentionRequirements) -> str | None:
    if needs.dtype not in spec.dtypes:
        return f"no {needs.dtype} (takes {', '.join(spec.dtypes)})"
    if spec.head_sizes is not None and needs.head_size not in spec.head_sizes:
        return f"head size {needs.head_size} unsupported (takes {', '.join(map(str, spec.head_sizes))})"
    if needs.sliding_window and not spec.supports_sliding_window:
        return "no sliding-window attention"
    if needs.logits_soft_cap and not spec.supports_logits_soft_cap:
        return "cannot soft-cap attention scores"
    if needs.block_size is not None and needs.block_size % spec.block_size_multiple:
        return f"block size {needs.block_size} is not a multiple of {spec.block_size_multiple}"
    kv_dtype = needs.kv_cache_dtype
    if kv_dtype != "auto" and kv_dtype not in spec.kv_cache_dtypes:
        return f"no {kv_dtype} KV cache (takes {', '.join(spec.kv_cache_dtypes)})"
    return None


def unsupported_reason(spec: AttentionBackendSpec, needs: AttentionRequirements,
                       device: DeviceDescription) -> str | None:
    """Why ``spec`` cannot run this model on this device, or None when it can."""
    return _device_reason(spec, device) or _model_reason(spec, needs)


@dataclass(frozen=True)
class RankedBackend:
    spec: AttentionBackendSpec
    priority: int
    reason: str | None  # None: it can run here


def rank_backends(specs: Iterable[AttentionBackendSpec], needs: AttentionRequirements,
                  device: DeviceDescription) -> list[RankedBackend]:
    """Every spec, highest priority on this platform first (ties by name), with why it cannot run."""
    ranked = [RankedBackend(spec, device.priority_of(spec), unsupported_reason(spec, needs, device)) for spec in specs]
    return sorted(ranked, key=lambda r: (-r.priority, r.spec.name))


@dataclass
class Selection:
    """The outcome: the backend built, its spec, and each backend ranked above it with why it was passed over."""

    backend: AttentionBackend
    spec: AttentionBackendSpec
    passed_over: list[tuple[str, str]]

    def describe(self) -> str:
        skipped = "; ".join(f"{name}: {why}" for name, why in self.passed_over) or "none ranked higher"
        return f"attention backend {self.spec.name} chosen; passed over: {skipped}"


Chooser = Callable[[list[AttentionBackendSpec]], "str | None"]
Builder = Callable[[AttentionBackendSpec], "AttentionBackend"]


def _on_this_device(ranked: RankedBackend, device: DeviceDescription) -> bool:
    return _device_reason(ranked.spec, device) is None


def choose_and_build(ranked: list[RankedBackend], needs: AttentionRequirements, device: DeviceDescription,
                     choose: Chooser, build: Builder) -> Selection:
    """Build the backend ``choose`` picks among the runnable ones, the next one when it fails to
    import or build; the user's ``needs.preferred`` must run here and build, or this raises."""
    by_name = {r.spec.name: r for r in ranked}
    runnable = [r.spec for r in ranked if r.reason is None]
    if needs.preferred is not None:
        _check_preferred(by_name, needs.preferred, runnable)
    failed: dict[str, str] = {}
    while True:
        candidates = [s for s in runnable if s.name not in failed]
        name = choose(candidates)
        if name is None or name not in by_name or name in failed:  # (a hook insisting on a failed one)
            tried = "; ".join(f"{n}: {why}" for n, why in failed.items())
            raise PluginError(f"no installed attention backend supports {needs} on {device.platform}"
                              f"{' (failed: ' + tried + ')' if tried else ''}; registered: {sorted(by_name)}")
        spec = by_name[name].spec
        try:
            backend = build(spec)
        except Exception as exc:
            if needs.preferred is not None:
                raise PluginError(f"attention backend {spec.name!r} failed to start: {exc}") from exc
            logger.warning("attention backend %s failed to start (%s); choosing another", spec.name, exc)
            failed[spec.name] = f"failed to start ({exc})"
            continue
        return Selection(backend, spec, _passed_over(ranked, spec, failed, device))


def _check_preferred(by_name: dict[str, RankedBackend], preferred: str, runnable: list[AttentionBackendSpec]) -> None:
    if preferred not in by_name:
        raise PluginError(f"attention backend {preferred!r} is not installed; have {sorted(by_name)}")
    reason = by_name[preferred].reason
    if reason is not None:
        can = ", ".join(s.name for s in runnable) or "none"
        raise PluginError(f"attention backend {preferred!r} cannot run here: {reason}; the ones that can: {can}")


def _passed_over(ranked: list[RankedBackend], chosen: AttentionBackendSpec, failed: dict[str, str],
                 device: DeviceDescription) -> list[tuple[str, str]]:
    """The backends of this device ranked above the chosen one, with their reasons."""
    out = []
    for r in ranked:
        if r.spec.name == chosen.name:
            break
        if not _on_this_device(r, device):
            continue
        out.append((r.spec.name, r.reason or failed.get(r.spec.name, "not chosen by a selection hook")))
    return out


def log_selection(selection: Selection, needs: AttentionRequirements) -> None:
    """One info line naming the choice and the reasons; a warning when a faster backend was
    passed over only for the model's head size (the reference then runs instead)."""
    logger.info("%s", selection.describe())
    head_size_misses = [name for name, why in selection.passed_over if why.startswith("head size")]
    if head_size_misses:
        logger.warning("head size %d is not supported by %s; falling back to %s, which is slower",
                       needs.head_size, ", ".join(head_size_misses), selection.spec.name)
