"""Which attention backend wins on which device, and why: the real specs of every installed
backend (those this repository ships: sdpa, cpu-paged, flash-attn, flashinfer, and triton where
installed) ranked against fake device descriptions with the real platforms' priorities."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenmill_platform_rocm.platform import ROCM_ATTENTION_PRIORITIES
from tokenmill_platform_xpu.platform import XPU_ATTENTION_PRIORITIES

from tokenmill import LLM, PluginError
from tokenmill.attention import AttentionRequirements, build_attention_backend
from tokenmill.attention.selection import DeviceDescription, choose_and_build, log_selection, rank_backends
from tokenmill.plugins import get_plugin_manager
from tokenmill_platform_cuda.platform import CUDA_ATTENTION_PRIORITIES


@pytest.fixture(scope="module")
def specs():
    manager = get_plugin_manager()
    registered = manager.collect_named("tokenmill_register_attention_backends", platform=None)
    assert {"sdpa", "cpu-paged", "flash-attn", "flashinfer"} <= set(registered)
    return [spec for _, spec in registered.values()]


def has_triton(specs) -> bool:
    return any(spec.name == "triton" for spec in specs)


def cuda(major: int, minor: int) -> DeviceDescription:
    return DeviceDescription("cuda", "cuda", (major, minor), CUDA_ATTENTION_PRIORITIES)


ON_CPU = not torch.cuda.is_available()
cpu_only = pytest.mark.skipif(not ON_CPU, reason="what a CPU-only machine has and lacks")


ROCM = DeviceDescription("rocm", "cuda", None, ROCM_ATTENTION_PRIORITIES)
XPU = DeviceDescription("xpu", "xpu", None, XPU_ATTENTION_PRIORITIES)
CPU = DeviceDescription("cpu", "cpu")


def needs(device: DeviceDescription, dtype: str = "bfloat16", head_size: int = 128, block_size: int = 16,
          **extra) -> AttentionRequirements:
    return AttentionRequirements(device_type=device.device_type, dtype=dtype, head_size=head_size,
                                 sliding_window=False, block_size=block_size, **extra)


def winner_and_reasons(specs, request, device):
    ranked = rank_backends(specs, request, device)
    runnable = [r.spec.name for r in ranked if r.reason is None]
    reasons = {r.spec.name: r.reason for r in ranked}
    return runnable[0], reasons


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (9, 0)])
def test_flash_attention_wins_from_ampere_on_with_256_token_blocks(specs, cc):
    winner, _ = winner_and_reasons(specs, needs(cuda(*cc), block_size=256), cuda(*cc))
    assert winner == "flash-attn"


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (9, 0)])
def test_flashinfer_takes_small_blocks_flash_attention_cannot_page(specs, cc):
    winner, reasons = winner_and_reasons(specs, needs(cuda(*cc)), cuda(*cc))
    assert winner == "flashinfer"
    assert reasons["flash-attn"] == "block size 16 is not a multiple of 256"


def test_volta_gets_neither_flash_kernel(specs):
    """Compute capability 7.0 is below both FlashAttention 2's 8.0 and FlashInfer's 7.5."""
    winner, reasons = winner_and_reasons(specs, needs(cuda(7, 0), block_size=256), cuda(7, 0))
    assert winner == ("triton" if has_triton(specs) else "sdpa")
    assert reasons["flash-attn"] == "needs compute capability >= 8.0, the device has 7.0"
    assert reasons["flashinfer"] == "needs compute capability >= 7.5, the device has 7.0"


def test_float32_passes_over_the_half_precision_kernels(specs):
    winner, reasons = winner_and_reasons(specs, needs(cuda(9, 0), dtype="float32", block_size=256), cuda(9, 0))
    assert winner == ("triton" if has_triton(specs) else "sdpa")
    assert reasons["flash-attn"].startswith("no float32")
    assert reasons["flashinfer"].startswith("no float32")


def test_rocm_takes_triton_and_never_the_cuda_builds(specs):
    winner, reasons = winner_and_reasons(specs, needs(ROCM, block_size=256), ROCM)
    assert winner == ("triton" if has_triton(specs) else "sdpa")
    assert reasons["flash-attn"] == "runs on the cuda platform, not rocm"
    assert reasons["flashinfer"] == "runs on the cuda platform, not rocm"
    assert reasons["cpu-paged"] == "runs on cpu, not cuda"


def test_xpu_runs_the_reference(specs):
    winner, reasons = winner_and_reasons(specs, needs(XPU), XPU)
    assert winner == "sdpa"
    assert reasons["flash-attn"] == "runs on cuda, not xpu"


def test_cpu_prefers_its_paged_kernel_then_sdpa(specs):
    ranked = [r for r in rank_backends(specs, needs(CPU), CPU) if r.reason is None]
    assert [r.spec.name for r in ranked] == ["cpu-paged", "sdpa"]
    winner, reasons = winner_and_reasons(specs, needs(CPU, dtype="float16"), CPU)
    assert winner == "sdpa" and reasons["cpu-paged"].startswith("no float16")


def test_soft_capped_model_passes_over_a_backend_without_the_cap(specs):
    winner, reasons = winner_and_reasons(specs, needs(CPU, dtype="float32", logits_soft_cap=True), CPU)
    assert winner == "sdpa" and reasons["cpu-paged"] == "cannot soft-cap attention scores"


def _first_runnable(candidates):
    return candidates[0].name if candidates else None


@cpu_only
def test_backends_that_cannot_import_are_passed_over_with_the_error(specs):
    """On an H200 description with 256-token blocks the engine tries flash-attn and flashinfer
    for real: neither library is installed here (or, for flashinfer, there is no CUDA device), so
    each fails to start and the next one down the list is built."""
    device = cuda(9, 0)
    request = needs(device, block_size=256, head_size=64)
    selection = choose_and_build(rank_backends(specs, request, device), request, device, _first_runnable,
                                 lambda spec: build_attention_backend(spec, block_size=256))
    passed = dict(selection.passed_over)
    assert passed["flash-attn"].startswith("failed to start")
    assert passed["flashinfer"].startswith("failed to start")
    assert selection.spec.name in {"triton", "sdpa"}
    assert "flash-attn: failed to start" in selection.describe()


def test_head_size_no_gpu_kernel_has_falls_back_to_the_reference_with_a_warning(specs, caplog):
    device = cuda(9, 0)
    request = needs(device, head_size=288, block_size=256)
    selection = choose_and_build(rank_backends(specs, request, device), request, device, _first_runnable,
                                 lambda spec: build_attention_backend(spec, block_size=256))
    assert selection.spec.name == "sdpa"
    with caplog.at_level(logging.INFO, logger="tokenmill.attention.selection"):
        log_selection(selection, request)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "head size 288" in warnings[0] and "flash-attn" in warnings[0]
    assert "falling back to sdpa" in warnings[0]


def test_forcing_a_backend_that_cannot_run_here_lists_those_that_can(specs):
    request = needs(CPU, dtype="float32", preferred="flash-attn")
    with pytest.raises(PluginError, match=r"'flash-attn' cannot run here: runs on cuda, not cpu; "
                                          r"the ones that can: cpu-paged, sdpa"):
        choose_and_build(rank_backends(specs, request, CPU), request, CPU, _first_runnable,
                         lambda spec: build_attention_backend(spec))


@cpu_only
def test_the_engine_refuses_a_forced_gpu_backend_on_the_cpu(llama_path):
    with pytest.raises(PluginError, match="the ones that can: cpu-paged, sdpa"):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="8MiB", attention_backend="flashinfer")


@cpu_only
def test_the_engine_logs_its_choice(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.attention.selection"):
        LLM(str(llama_path), dtype="float16", max_model_len=64, kv_cache_memory="8MiB")
    lines = [r.getMessage() for r in caplog.records if "chosen" in r.getMessage()]
    assert lines == ["attention backend sdpa chosen; passed over: cpu-paged: no float16 (takes float32, bfloat16)"]


@cpu_only
def test_plugins_command_shows_the_order_on_this_machine():
    from typer.testing import CliRunner

    from tokenmill_cli.main import app

    result = CliRunner().invoke(app, ["plugins", "--dtype", "float16", "--head-size", "64"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("attention backends on cpu (float16, head size 64)"):]
    rows = [line for line in table.splitlines() if "│" in line]
    assert "sdpa" in rows[-1] and rows[-1].split("│")[1].strip() == "1"  # the only one that runs float16 here
    cpu_paged = next(row for row in rows if "cpu-paged" in row)
    assert "no float16" in cpu_paged


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="needs a CUDA GPU")
def test_the_engine_on_a_gpu_logs_why_flash_attention_was_passed_over(llama_path, caplog):
    """16-token blocks (the default) are below FlashAttention 2's paged minimum on any GPU."""
    from worker_probe import attention_backend

    with caplog.at_level(logging.INFO, logger="tokenmill.attention.selection"):
        llm = LLM(str(llama_path), max_model_len=64, kv_cache_memory="64MiB")
    line = next(r.getMessage() for r in caplog.records if "chosen" in r.getMessage())
    assert "flash-attn: block size 16 is not a multiple of 256" in line
    assert line.startswith(f"attention backend {attention_backend(llm)} chosen")


@cpu_only
def test_plugins_command_takes_the_order_for_a_model_folder(tmp_path):
    """Gemma 2 soft-caps its scores: for it the CPU's paged kernel is out of the order."""
    from family_models import build_family_model
    from typer.testing import CliRunner

    from tokenmill_cli.main import app

    gemma2 = build_family_model(tmp_path, "gemma2")
    result = CliRunner().invoke(app, ["plugins", "--dtype", "float32", "--model", str(gemma2)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("attention backends on cpu (float32"):]
    cpu_paged = next(row for row in table.splitlines() if "cpu-paged" in row)
    assert "cannot soft-cap attention scores" in cpu_paged
