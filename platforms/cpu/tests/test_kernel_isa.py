"""``TOKENMILL_CPU_ISA``: the kernels built for a lower instruction set than the CPU's own,
in a build folder of their own, refused for a level the CPU lacks; and the AVX2+FMA bodies
checked against the torch reference by rerunning the kernel tests on an AVX2 build (a child
pytest: the level is chosen when the kernels are built, once per process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill_platform_cpu.kernels import (
    CFLAGS,
    ISA_VARIABLE,
    UnsupportedKernelIsa,
    build_directory,
    check_isa,
    compile_flags,
    kernel_isa,
    kernels_available,
    library_path,
    load_kernels,
    native_isa,
)

# /proc/cpuinfo's flags line of an AVX2-only EPYC (Zen 3), abridged to the vector and bit-manipulation flags
AVX2_ONLY = "flags\t\t: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes avx f16c abm bmi1 avx2 bmi2 sha_ni"
TESTS = Path(__file__).parent


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def test_a_level_the_cpu_lacks_is_refused_by_name():
    check_isa("avx2", AVX2_ONLY)
    check_isa("native", AVX2_ONLY)
    with pytest.raises(UnsupportedKernelIsa, match="avx512: this CPU lacks avx512f avx512bw"):
        check_isa("avx512", AVX2_ONLY)
    with pytest.raises(UnsupportedKernelIsa, match="not one of native, avx2, avx512, avx512_bf16"):
        check_isa("avx3", AVX2_ONLY)
    assert native_isa(AVX2_ONLY) == "avx2"
    assert native_isa("flags\t\t: fpu sse2") == "baseline"


def test_the_default_builds_for_the_cpu_itself(monkeypatch):
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    assert compile_flags() == CFLAGS
    assert kernel_isa().endswith("(native)")


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= _cpu_flags(), reason="needs an AVX2 CPU")
def test_a_forced_level_replaces_march_native_in_a_build_folder_of_its_own(monkeypatch):
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    native_folder = build_directory()
    monkeypatch.setenv(ISA_VARIABLE, "AVX2")  # any case
    flags = compile_flags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert build_directory() != native_folder
    assert kernel_isa() == "avx2"
    monkeypatch.setenv(ISA_VARIABLE, "avx3")
    with pytest.raises(UnsupportedKernelIsa):
        kernel_isa()  # what load_kernels asks first: a bad level fails the engine's start, not just its kernels


@pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
def test_the_loaded_build_is_the_one_for_the_requested_level():
    """Run by the AVX2 rerun below as well: its build records the level it was made for."""
    folder = build_directory()
    assert Path(load_kernels().__file__) == library_path(folder)
    recorded = (folder / "cpu-flags").read_text()
    requested = os.environ.get(ISA_VARIABLE, "").lower()
    assert recorded.startswith(f"{ISA_VARIABLE}={requested}\n") if requested else recorded.startswith("flags")


@pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_with_more_query_heads_per_kv_head_than_one_pass_takes(dtype):
    """Six query heads on one KV head: the AVX2 body scores keys four heads at a time (and the
    AVX-512 one all at once); head size 128 also takes the AVX2 body's two value passes."""
    torch.manual_seed(0)
    heads, head, block, seq = 6, 128, 4, 11
    keys, values = torch.randn(seq, 1, head).to(dtype), torch.randn(seq, 1, head).to(dtype)
    key_cache = torch.zeros(4, block, 1, head, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    blocks = [2, 0, 3]
    for pos in range(seq):
        key_cache[blocks[pos // block], pos % block] = keys[pos]
        value_cache[blocks[pos // block], pos % block] = values[pos]
    query = torch.randn(1, heads, head).to(dtype)
    out = load_kernels().paged_attention(query, key_cache, value_cache, torch.tensor([blocks]), torch.tensor([0]),
                                         torch.tensor([seq - 1]), head**-0.5, 0)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double().transpose(0, 1), keys.double().transpose(0, 1).expand(heads, seq, head),
        values.double().transpose(0, 1).expand(heads, seq, head)).transpose(0, 1)
    tolerance = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.long  # an AVX2 build of the kernels from scratch (~150 s on the CI machine), then their tests
@pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
@pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="the default run already tests the AVX2 bodies here")
@pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= _cpu_flags(), reason="needs an AVX2 CPU")
def test_the_avx2_build_passes_the_kernel_tests():
    """The AVX2+FMA bodies against the torch reference: the kernel tests rerun on an AVX2 build
    (in the same kernel cache, so a second run loads it), which must hold no AVX-512 instruction."""
    env = dict(os.environ, **{ISA_VARIABLE: "avx2"})
    files = ["test_layer_ops.py", "test_paged_attention.py", "test_sampling_kernel.py", "test_non_finite.py",
             "test_grouped_moe_kernel.py", "test_grouped_moe_lanes.py", "test_kernel_isa.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not long",
                          *[str(TESTS / name) for name in files]], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    objdump = shutil.which("objdump")
    if objdump is not None:
        library = subprocess.run([sys.executable, "-c", "from tokenmill_platform_cpu.kernels import load_kernels; "
                                  "print(load_kernels().__file__)"], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip()
        code = subprocess.run([objdump, "-d", "--no-show-raw-insn", library], capture_output=True, text=True,
                              check=True).stdout
        assert "%zmm" not in code, "the AVX2 build holds AVX-512 instructions: it would fault on an AVX2 CPU"
