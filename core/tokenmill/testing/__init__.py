"""tokenmill's conformance kit: the checks a plugin's own test suite runs.

A pytest plugin, opted into explicitly (``pytest -p tokenmill.testing``, or
``addopts = "-p tokenmill.testing"`` in the plugin's pytest configuration), rather
than a ``pytest11`` entry point: tokenmill-core is installed wherever tokenmill is, and
an entry point would load into every pytest run of every project in that environment.
This module imports nothing but pytest, so loading it costs nothing; the kits import
torch when a test module imports them:

* :mod:`tokenmill.testing.attention` — :class:`~tokenmill.testing.attention.AttentionBackendConformance`:
  paged metadata cases against the definition and the SDPA reference backend;
* :mod:`tokenmill.testing.platform` — :class:`~tokenmill.testing.platform.PlatformConformance`:
  detection, memory reporting, a tiny generation against transformers;
* :mod:`tokenmill.testing.quantization` — :class:`~tokenmill.testing.quantization.QuantizationConformance`:
  a linear layer loaded from on-disk tensors against its dequantised weight;
* :mod:`tokenmill.testing.models` — :class:`~tokenmill.testing.models.ModelConformance`:
  greedy tokens against transformers on a tiny config the plugin gives;
  :mod:`tokenmill.testing.pooling_models` — :class:`~tokenmill.testing.pooling_models.PoolingModelConformance`:
  an encoder's pooled embeddings against transformers' hidden states.

A test module subclasses one of them as ``class TestSomething(...)`` and sets its class
attributes; docs/plugins.md ("Testing a plugin with the conformance kit") shows each.
The classes parametrise their own tests (:mod:`tokenmill.testing.kit_base`), so they run
without this plugin too; what it adds: the ``--tokenmill-kit=small|full`` option (``full``
adds the larger attention cases), the ``tokenmill_kit`` marker on every kit test
(``-m "not tokenmill_kit"`` leaves them out) and the ``gpu`` marker.
"""

from __future__ import annotations

from typing import Any

import pytest

KIT_MARKER = "tokenmill_kit"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokenmill", "tokenmill conformance kit")
    group.addoption("--tokenmill-kit", choices=("small", "full"), default="small",
                    help="the conformance kit's case set: small (the default, seconds) or full (more head and "
                         "block sizes, longer sequences)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{KIT_MARKER}: a case of tokenmill's conformance kit (tokenmill.testing)")
    config.addinivalue_line("markers", "gpu: needs a GPU")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        cls: Any = getattr(item, "cls", None)
        if cls is not None and any(base.__name__ == "KitTestClass" for base in cls.__mro__):
            item.add_marker(KIT_MARKER)
