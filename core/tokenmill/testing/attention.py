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

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch

from tokenmill.attention.backend import AttentionBackend
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


def registered_attention_spec(name: str, platform: Any = None) -> AttentionBackendSpec | None:
    """The installed plugins' spec called ``name`` (None when no plugin registers it)."""
    from tokenmill.plugins import get_plugin_manager

    named = get_plugin_manager().collect_named("tokenmill_register_attention_backends", platform=platform)
    return named[name][1] if name in named else None


class AttentionBackendConformance(KitTestClass):
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

    def run_backend(self, backend: AttentionBackend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of ``backend`` on its own copy of the batch's cache: output, K cache, V cache."""
        case = batch.case
        key_cache, value_cache = batch.copy_caches()
        layer = Attention(case.num_heads, case.head_size, case.num_kv_heads, case.head_size ** -0.5,
                          sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap)
        metadata = _fresh(batch)
        metadata.backend_data = backend.prepare(metadata)
        out = backend.forward(layer, batch.query, batch.key, batch.value, (key_cache, value_cache), metadata)
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

    def _check_cache_writes(self, batch: PagedBatch, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """The new K/V are at their slots; every other slot is as it was."""
        slots = batch.metadata.slot_mapping
        for name, written, before, new in (("key", key_cache, batch.key_cache, batch.key),
                                           ("value", value_cache, batch.value_cache, batch.value)):
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
