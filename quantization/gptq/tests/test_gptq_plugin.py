"""Where quantization methods run: ``tokenmill plugins`` shows each method's devices and dtypes,
and a method whose spec does not list the platform's device is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.errors import UnsupportedQuantizationError
from tokenmill.model_loader.quant_config import check_runs_on
from tokenmill.plugins.specs import QuantMethodSpec
from tokenmill_quant_gptq import GPTQ_METHOD

CUDA_ONLY = QuantMethodSpec(name="marlin", qualname="x:Y", devices=("cuda",), dtypes=("float16", "bfloat16"))


def test_a_method_that_does_not_run_on_the_device_is_refused_naming_what_would():
    with pytest.raises(UnsupportedQuantizationError, match=r"'marlin' does not run on cpu \(it runs on cuda\); "
                                                           r"methods that run on cpu: gptq$"):
        check_runs_on(CUDA_ONLY, [CUDA_ONLY, GPTQ_METHOD], "cpu")
    check_runs_on(CUDA_ONLY, [CUDA_ONLY, GPTQ_METHOD], "cuda")
    check_runs_on(GPTQ_METHOD, [CUDA_ONLY, GPTQ_METHOD], "xpu")  # no devices listed: anywhere


def test_the_plugins_command_shows_where_each_method_runs():
    from tokenmill.plugins import get_plugin_manager
    from tokenmill_cli.plugins import _registered_names

    registered = _registered_names(get_plugin_manager(reload=True))
    assert registered["gptq"] == ["quantization-methods: gptq (any device; float32, bfloat16, float16)"]
    result = subprocess.run([sys.executable, "-m", "tokenmill_cli.main", "plugins"], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "quantization-methods: gptq (any device;" in result.stdout  # the table (wrapped at 160 columns)
