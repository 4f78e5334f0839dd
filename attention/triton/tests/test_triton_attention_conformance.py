"""The Triton backend through the conformance kit (``tokenmill.testing``): on the CPU
under Triton's interpreter in a child pytest (the variable must be set before triton is
first imported), and on a CUDA GPU (``-m gpu``) where one is.

Under the interpreter the kit runs the CPU registration ``triton-interpreted`` (the same
class) in float32 and float16: the interpreter's ``tl.dot`` on bfloat16 inputs is wrong
(numpy has no bfloat16), so bfloat16 is checked on the GPU."""

from __future__ import annotations

import os
from types import MappingProxyType

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("tokenmill.testing")

from tokenmill.testing.attention import AttentionBackendConformance
from tokenmill.testing.child import run_pytest_child

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class TestTritonInterpretedConformance(AttentionBackendConformance):
    backend_name = "triton-interpreted"
    device = "cpu"
    dtypes = ("float32", "float16")
    required_env = MappingProxyType({"TRITON_INTERPRET": "1"})


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_conformance_under_the_interpreter():
    run_pytest_child(f"{__file__}::TestTritonInterpretedConformance", env={"TRITON_INTERPRET": "1"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestTritonGpuConformance(AttentionBackendConformance):
    backend_name = "triton"
    device = "cuda"
    dtypes = ("float32", "bfloat16", "float16")
