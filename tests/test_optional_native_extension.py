"""tokenmill.plugin_api.optional_native_extension: a kernel that does not build is None and a
warning saying why and what runs instead (the one copy of what the int8, GGUF, packed-int and
fp8 loaders each used to spell out)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenmill.plugin_api import optional_native_extension


def test_a_kernel_the_compiler_refuses_is_none_and_says_what_runs_instead(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path / "kernels"))
    source = tmp_path / "refused.cpp"
    source.write_text("#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n")
    with caplog.at_level(logging.WARNING, logger="tokenmill.native_extension"):
        module = optional_native_extension("tokenmill_refused_kernel", "refused", [source],
                                           ["-fno-such-flag-for-any-compiler"], "refused test kernel",
                                           fallback="the torch path")
    assert module is None
    assert "refused test kernel unavailable (" in caplog.text and "; the torch path runs" in caplog.text


def test_an_edited_header_beside_the_source_gets_a_build_of_its_own(tmp_path: Path, monkeypatch):
    """A kernel's source includes the headers in its folder by a relative name (the int8 kernel's
    AVX2 bodies): the build folder's name hashes them too, or an edited header would load the old build."""
    from tokenmill.native_extension import build_directory

    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path / "kernels"))
    source, header = tmp_path / "kernel.cpp", tmp_path / "bodies.h"
    source.write_text('#include "bodies.h"\n')
    header.write_text("constexpr int kWidth = 8;\n")
    before = build_directory("test", [source], ["-O2"])
    assert build_directory("test", [source], ["-O2"]) == before
    header.write_text("constexpr int kWidth = 16;\n")
    assert build_directory("test", [source], ["-O2"]) != before
