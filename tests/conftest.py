from __future__ import annotations

import functools
from pathlib import Path

import pytest
from tiny_models import build_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    """``model_factory(arch)`` -> folder of a tiny checkpoint, built once per session."""
    return functools.cache(lambda arch: build_model(tmp_path_factory.mktemp(arch), arch))


@pytest.fixture(scope="session")
def llama_path(model_factory) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="session")
def fault_model_path(llama_path, tmp_path_factory) -> Path:
    """The tiny Llama behind the fault-injection plugin (poison tokens in ``fault_model``)."""
    from fault_model import build_fault_model

    return build_fault_model(llama_path, tmp_path_factory.mktemp("faulty"))
