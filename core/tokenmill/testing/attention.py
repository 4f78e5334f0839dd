"""Conformance of an attention backend: paged batches against the definition and SDPA.

Subclass :class:`AttentionBackendConformance` in a test module (its name starting with
``Test``) and say which backend, on which device, in which dtypes::

    class TestMyBackend(AttentionBackendConformance):
        backend_name = "my-backend"        # its registered AttentionBackendSpec says what it supports
        device = "cuda"
        dtypes = ("float16", "bfloat16")
        block_sizes = (16, 32)             # None: any
        unsupported_cases = {"block-size-1": "the kernel's tiles need 16 rows"}

Each case of :data:`~tokenmill.testing.attention_cases.DEFAULT_CASES` (``--tokenmill-kit=full``:
more) runs in each dtype: the backend's ``prepare`` then ``forward`` on the batch, whose
output must match the float64 definition and the SDPA reference backend (when installed)
within the dtype's tolerance, and whose KV cache afterwards must hold the new keys and
values at the slot mapping and nothing else changed. A case the backend's spec or the
class rules out (head size, sliding window, soft cap, block size, a named exclusion) is
skipped with the reason, so a run's summary shows what was not checked.

``backend`` (a ``"module:Class"`` or the class) points the kit at a class that is not
registered yet, with ``spec`` (an :class:`~tokenmill.plugin_api.AttentionBackendSpec`) saying
what it supports (without one: the class's device, every dtype, a sliding window, no soft
cap); :meth:`make_backend` builds it (``cls(block_size=...)`` by default).
``required_env``: the cases run only where these environment variables are set (a Triton
kernel under ``TRITON_INTERPRET=1``, which must be set before triton is imported, so in a
child pytest: :func:`tokenmill.testing.child.run_pytest_child`); elsewhere they skip.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import pytest
import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.kv_cache.fp8 import FP8_KV_CACHE_DTYPES, dequantize_kv, quantize_kv
from tokenmill.layers.attention import Attention
from tokenmill.plugins.specs import AttentionBackendSpec, resolve_qualname
from tokenmill.testing.attention_cases import (
    DEFAULT_CASES,
    AttentionCase,
    PagedBatch,
    build_paged_batch,
    reference_attention,
)
from tokenmill.testing.kit_base import KitTestClass

REFERENCE_BACKEND = "sdpa"
# (atol, rtol) against the float64 definition; inputs are N(0, 1), outputs of order 1.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (2e-5, 1e-4),
    "float16": (5e-3, 5e-3),
    "bfloat16": (3e-2, 3e-2),
}


# -- fp8 KV cache -----------------------------------------------------------------------

# Power-of-two scales, as calibrated checkpoints' k_scale/v_scale are in spirit (not 1.0, so a
# backend that forgets one is caught): the rounded values are then exact in every model dtype.
FP8_KV_SCALES = (0.5, 0.25)


def fp8_kv_bound(kv_cache_dtype: str) -> float:
    """How far attention over an fp8 KV cache may stray from the float cache's, for the kit's
    N(0, 1) inputs: rounding to float8 with m mantissa bits errs by at most u = 2**-(m+1) of a
    value (e4m3: 1/16, e5m2: 1/8); the output, a convex combination of values of magnitude up
    to about 4 (the kit's N(0, 1) draws), moves through V by at most 4u, and K's rounding moves
    the weights by less than that on these shapes. Bound: 4u (0.25 / 0.5); SDPA measured at
    most 0.13 (e4m3) and 0.28 (e5m2) over the default cases in float32 and bfloat16."""
    mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[kv_cache_dtype]
    return 4 * 2.0 ** -(mantissa + 1)


def fp8_rounded(batch: PagedBatch, kv_cache_dtype: str, scales: tuple[float, float] = FP8_KV_SCALES) -> PagedBatch:
    """The batch with its KV cache in float8 (the slots an earlier step wrote, quantised with
    ``scales``) and its per-request keys/values the ones that cache holds, dequantised: the
    reference over these is what attention over the fp8 cache computes exactly."""
    import dataclasses

    fp8 = FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    k_scale, v_scale = scales

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize_kv(quantize_kv(x, scale, fp8), scale, x.dtype)

    return dataclasses.replace(
        batch, key=rounded(batch.key, k_scale), value=rounded(batch.value, v_scale),
        key_cache=quantize_kv(batch.key_cache, k_scale, fp8), value_cache=quantize_kv(batch.value_cache, v_scale, fp8),
        sequence_keys=[rounded(k, k_scale) for k in batch.sequence_keys],
        sequence_values=[rounded(v, v_scale) for v in batch.sequence_values])


class FP8KVCacheConformance:
    """Mixed into :class:`AttentionBackendConformance`: for each fp8 KV dtype the spec declares
    (``kv_cache_dtypes``), every case must match the definition over the rounded keys and values
    (the dtype's tolerance), stay within :func:`fp8_kv_bound` of the float cache's output, and
    leave the cache holding the quantised new tokens at their slots, the other bytes untouched.
    A backend declaring no fp8 KV dtype skips it."""

    def test_fp8_kv_cache(self, attention_case: AttentionCase, attention_dtype: str) -> None:
        kit = cast("AttentionBackendConformance", self)
        kit._skip_unless_runnable(attention_case, attention_dtype)
        fp8_names = [name for name in kit.backend_spec().kv_cache_dtypes if name != "auto"]
        if not fp8_names:
            pytest.skip("the spec declares no fp8 KV cache dtype")
        dtype = getattr(torch, attention_dtype)
        batch = build_paged_batch(attention_case, kit.device, dtype)
        atol, rtol = kit.tolerances[attention_dtype]
        for name in fp8_names:
            rounded = fp8_rounded(batch, name)
            out, key_cache, value_cache = kit.run_backend(kit.make_backend(attention_case.block_size), rounded,
                                                          new_kv=(batch.key, batch.value), scales=FP8_KV_SCALES)
            assert out.dtype == dtype, f"{name}: output in {out.dtype}, expected {dtype}"
            torch.testing.assert_close(out.double().cpu(), reference_attention(rounded), atol=atol, rtol=rtol,
                                       msg=functools.partial(_prefixed, f"{name}, against the definition over the "
                                                                        "rounded KV"))
            error = float((out.double().cpu() - reference_attention(batch)).abs().max())
            assert error <= fp8_kv_bound(name), f"{name}: {error} from the float KV cache's output"
            stored = (quantize_kv(batch.key, FP8_KV_SCALES[0], key_cache.dtype),
                      quantize_kv(batch.value, FP8_KV_SCALES[1], value_cache.dtype))
            kit._check_cache_writes(rounded, key_cache, value_cache, new_stored=stored)


def _prefixed(prefix: str, message: str) -> str:
    return f"{prefix}: {message}"


def registered_attention_spec(name: str, platform: Any = None) -> AttentionBackendSpec | None:
    """The installed plugins' spec called ``name`` (None when no plugin registers it)."""
    from tokenmill.plugins import get_plugin_manager

    named = get_plugin_manager().collect_named("tokenmill_register_attention_backends", platform=platform)
    return named[name][1] if name in named else None


class AttentionBackendConformance(KitTestClass, FP8KVCacheConformance):
    """Base of a backend's conformance tests (not collected itself: no ``Test`` prefix)."""

    backend_name: ClassVar[str | None] = None
    backend: ClassVar[str | type | None] = None
    spec: ClassVar[AttentionBackendSpec | None] = None
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    block_sizes: ClassVar[tuple[int, ...] | None] = None
    unsupported_cases: ClassVar[Mapping[str, str]] = {}
    required_env: ClassVar[Mapping[str, str]] = {}
    tolerances: ClassVar[Mapping[str, tuple[float, float]]] = TOLERANCES
    compare_with_reference_backend: ClassVar[bool] = True

    # -- what the plugin may override -------------------------------------------------

    @classmethod
    def backend_spec(cls) -> AttentionBackendSpec:
        if cls.spec is not None:
            return cls.spec
        if cls.backend_name is None:
            if cls.backend is None:
                raise TypeError(f"{cls.__name__}: set backend_name (a registered backend), or backend (and spec)")
            # An unregistered class: it runs on the class's device, in any dtype, with a window, no soft cap.
            qualname = cls.backend if isinstance(cls.backend, str) else f"{cls.backend.__module__}:{cls.backend.__qualname__}"
            return AttentionBackendSpec(name=qualname, qualname=qualname, device_types=(torch.device(cls.device).type,))
        spec = registered_attention_spec(cls.backend_name)
        if spec is None:
            pytest.fail(f"no installed plugin registers the attention backend {cls.backend_name!r}")
        return spec

    @classmethod
    def cases(cls, full: bool = False) -> tuple[AttentionCase, ...]:
        """The cases this class runs; ``full``: ``--tokenmill-kit=full`` was given."""
        from tokenmill.testing.attention_cases import full_cases

        return full_cases() if full else DEFAULT_CASES

    @classmethod
    def tokenmill_kit_parameters(cls, full: bool) -> list[tuple[str, list[Any], list[str]]]:
        """How the kit's pytest plugin parametrises the tests: every case in every dtype."""
        cases = list(cls.cases(full))
        return [("attention_case", cases, [case.name for case in cases]),
                ("attention_dtype", list(cls.dtypes), list(cls.dtypes))]

    def make_backend(self, block_size: int) -> AttentionBackend:
        target = self.backend if self.backend is not None else self.backend_spec().qualname
        backend_cls = resolve_qualname(target) if isinstance(target, str) else target
        return backend_cls(block_size=block_size)

    # -- the checks -------------------------------------------------------------------

    def skip_reason(self, case: AttentionCase, dtype: str) -> str | None:
        """Why this backend does not run ``case`` in ``dtype`` (None: it must)."""
        spec = self.backend_spec()
        if case.name in self.unsupported_cases:
            return f"declared unsupported: {self.unsupported_cases[case.name]}"
        if spec.head_sizes is not None and case.head_size not in spec.head_sizes:
            return f"head size {case.head_size} is not in the spec's {spec.head_sizes}"
        if case.sliding_window is not None and not spec.supports_sliding_window:
            return "the spec declares no sliding window"
        if case.logits_soft_cap is not None and not spec.supports_logits_soft_cap:
            return "the spec declares no logits soft cap"
        if dtype not in spec.dtypes:
            return f"{dtype} is not in the spec's dtypes {spec.dtypes}"
        if self.block_sizes is not None and case.block_size not in self.block_sizes:
            return f"block size {case.block_size} is not one of {self.block_sizes}"
        return None

    def _skip_unless_runnable(self, case: AttentionCase, dtype: str) -> None:
        missing = {k: v for k, v in self.required_env.items() if os.environ.get(k) != v}
        if missing:
            pytest.skip(f"runs only with {missing} in the environment (in a child pytest)")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if device.type not in self.backend_spec().device_types:
            pytest.fail(f"{self.device} is not among the spec's device types {self.backend_spec().device_types}")
        reason = self.skip_reason(case, dtype)
        if reason is not None:
            pytest.skip(reason)

    def run_backend(self, backend: AttentionBackend, batch: PagedBatch,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of ``backend`` on its own copy of the batch's cache: output, K cache, V cache.
        ``new_kv``: the new tokens' keys/values to hand it (default: the batch's); ``scales``: the
        layer's ``k_scale``/``v_scale`` (an fp8 cache's)."""
        case = batch.case
        key_cache, value_cache = batch.copy_caches()
        layer = Attention(case.num_heads, case.head_size, case.num_kv_heads, case.head_size ** -0.5,
                          sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap)
        layer.k_scale, layer.v_scale = scales
        key, value = new_kv if new_kv is not None else (batch.key, batch.value)
        metadata = _fresh(batch)
        metadata.backend_data = backend.prepare(metadata)
        out = backend.forward(layer, batch.query, key, value, (key_cache, value_cache), metadata)
        return out, key_cache, value_cache

    def test_matches_reference(self, attention_case: AttentionCase, attention_dtype: str) -> None:
        self._skip_unless_runnable(attention_case, attention_dtype)
        dtype = getattr(torch, attention_dtype)
        batch = build_paged_batch(attention_case, self.device, dtype)
        out, key_cache, value_cache = self.run_backend(self.make_backend(attention_case.block_size), batch)

        assert out.shape == batch.query.shape, f"output {tuple(out.shape)}, expected {tuple(batch.query.shape)}"
        assert out.dtype == dtype and out.device.type == torch.device(self.device).type
        atol, rtol = self.tolerances[attention_dtype]
        torch.testing.assert_close(out.double().cpu(), reference_attention(batch), atol=atol, rtol=rtol,
                                   msg=lambda m: f"against the definition ({attention_case.name}): {m}")
        self._check_cache_writes(batch, key_cache, value_cache)
        if self.compare_with_reference_backend:
            self._check_against_sdpa(batch, out, atol, rtol)

    def _check_cache_writes(self, batch: PagedBatch, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            new_stored: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The new K/V are at their slots; every other slot is as it was. ``new_stored``: what a
        float8 cache must hold for the new K/V (compared byte for byte)."""
        slots = batch.metadata.slot_mapping
        news = new_stored if new_stored is not None else (batch.key, batch.value)
        for name, written, before, new in (("key", key_cache, batch.key_cache, news[0]),
                                           ("value", value_cache, batch.value_cache, news[1])):
            if new_stored is not None:
                written, before, new = written.view(torch.uint8), before.view(torch.uint8), new.view(torch.uint8)
            flat_written = written.reshape(-1, *written.shape[2:])
            expected = before.reshape(-1, *before.shape[2:]).clone()
            expected[slots] = new
            assert torch.equal(flat_written, expected), f"the {name} cache after the step is not the old one with " \
                                                        "the new tokens at slot_mapping"

    def _check_against_sdpa(self, batch: PagedBatch, out: torch.Tensor, atol: float, rtol: float) -> None:
        spec = registered_attention_spec(REFERENCE_BACKEND)
        if spec is None or spec.qualname == self.backend_spec().qualname:
            return  # not installed, or the reference itself (checked against the definition above)
        reference = resolve_qualname(spec.qualname)(block_size=batch.case.block_size)
        expected, _, _ = self.run_backend(reference, batch)
        torch.testing.assert_close(out.float(), expected.float(), atol=2 * atol, rtol=2 * rtol,
                                   msg=lambda m: f"against the SDPA reference backend ({batch.case.name}): {m}")


def _fresh(batch: PagedBatch) -> Any:
    """The batch's metadata without a previous backend's ``backend_data``."""
    import dataclasses

    return dataclasses.replace(batch.metadata, backend_data=None)
