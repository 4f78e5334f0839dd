"""The parallel-loop seam (core/tokenmill/csrc/include/tokenmill/parallel_abi.h): plugin kernels built
with ``<tokenmill/parallel.h>`` run their loops on the CPU platform's pool once it is published.

What is checked is where a loop runs (the pool counts the plugin loops handed to it), that the
result is the same bits as on at::parallel_for, and the attaching order (an extension imported
before the platform publishes is attached when it does). No timing is asserted: what the one pool
saves is measured by ``scripts/profile_step.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenmill.native_extension import _ParallelSeam
from tokenmill.plugin_api import attached_extensions
from tokenmill_platform_cpu.kernels import kernels_available, load_kernels

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")


@pytest.fixture
def platform_pool() -> Iterator[object]:
    """The CPU platform's kernels (loading them publishes the pool) on two threads, restored after."""
    kernels = load_kernels()
    threads, mode = kernels.pool_threads(), kernels.thread_pool()
    kernels.set_pool_threads(2)
    yield kernels
    kernels.set_thread_pool(mode)
    kernels.set_pool_threads(threads)


def _gguf_kernel():  # type: ignore[no-untyped-def]  # a compiled module
    from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel

    kernel = load_cpu_kernel()
    if kernel is None:
        pytest.skip("the GGUF CPU kernel did not build here")
    return kernel


def _q8_0_matmul(rows: int = 512, k: int = 256) -> torch.Tensor:
    """One GGUF Q8_0 matmul of a decode row (the kernel's loop over the output rows)."""
    rng = np.random.default_rng(0)
    qweight = torch.from_numpy(np.ascontiguousarray(quantize(rng.standard_normal((rows, k)).astype(np.float32),
                                                             GGMLQuantizationType.Q8_0)))
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    return torch.ops.tokenmill_gguf.matmul(x, qweight, int(GGMLQuantizationType.Q8_0), k, None, "float32")


def test_a_gguf_matmuls_loop_runs_on_the_platforms_pool(platform_pool) -> None:
    kernel = _gguf_kernel()
    # by name: on the build that made it, the module keeps the path it was built at (a staging folder)
    assert Path(kernel.__file__).name in {path.name for path in attached_extensions()}
    before = platform_pool.thread_pool_stats()["plugin_loops"]
    on_pool = _q8_0_matmul()
    assert platform_pool.thread_pool_stats()["plugin_loops"] > before
    platform_pool.set_thread_pool("openmp")  # the platform's other loop: the same bits
    assert torch.equal(_q8_0_matmul(), on_pool)


def test_the_int8_fp8_and_packed_int_kernels_are_attached_too(platform_pool) -> None:
    from tokenmill.layers.packed_int_cpu import packed_int_kernel_runs
    from tokenmill_quant_fp8.cpu_kernel import load_fp8_cpu_kernel
    from tokenmill_quant_int8.cpu_kernel import load_w8a8_kernel

    if load_w8a8_kernel() is None or load_fp8_cpu_kernel() is None or not packed_int_kernel_runs():
        pytest.skip("the int8, fp8 or packed-int CPU kernel does not run here")
    names = {path.name for path in attached_extensions()}
    assert {"tokenmill_int8_kernel.so", "tokenmill_fp8_kernel.so", "tokenmill_packed_int_kernel.so"} <= names


def test_an_extension_imported_before_the_platform_publishes_is_attached_when_it_does(platform_pool) -> None:
    library = Path(_gguf_kernel().__file__)
    seam = _ParallelSeam()  # a process where the platform has not published yet
    seam.add_extension(library)
    assert seam.attached() == []
    seam.publish(platform_pool.parallel_backend())
    assert seam.attached() == [library]


def test_a_capsule_that_is_not_a_parallel_backend_is_refused(platform_pool) -> None:
    seam = _ParallelSeam()
    with pytest.raises(ValueError, match=r"named tokenmill\.parallel_backend"):
        seam.publish(_other_capsule())


def _other_capsule() -> object:
    make = ctypes.pythonapi.PyCapsule_New
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make(ctypes.c_void_p(1), b"something.else", None)
