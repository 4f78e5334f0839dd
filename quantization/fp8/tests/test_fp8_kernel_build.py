"""The FP8 CPU kernel is built wherever its vector bodies run: AVX-512 F/BW/VL, or AVX2 with FMA
and F16C (its AVX2 body). The kernel's own tests skip where it does not load, so this is what
fails if a build that should run here does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenmill_quant_fp8.cpu_kernel import load_fp8_cpu_kernel


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return set(next((line for line in lines if line.startswith("flags")), "").partition(":")[2].split())


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_kernel_builds_for_the_cpus_instruction_set() -> None:
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        pytest.skip("neither AVX-512 nor AVX2 here: the torch path runs")
    module = load_fp8_cpu_kernel()
    assert module is not None and module.isa() == expected
