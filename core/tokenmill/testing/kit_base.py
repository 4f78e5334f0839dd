"""What every conformance base class shares: it parametrises its own tests.

pytest calls a test class's ``pytest_generate_tests`` method for each of its test
functions, so the kit's classes need no plugin to get their cases: with ``-p
tokenmill.testing`` loaded, ``--tokenmill-kit=full`` widens them; without it the small
set runs.
"""

from __future__ import annotations

from typing import Any

import pytest

KIT_OPTION = "--tokenmill-kit"


class KitTestClass:
    """Base of the kit's conformance classes."""

    @classmethod
    def tokenmill_kit_parameters(cls, full: bool) -> list[tuple[str, list[Any], list[str]]]:
        """``(argument, values, ids)`` to parametrise each test taking that argument with."""
        return []

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        full = metafunc.config.getoption(KIT_OPTION, default="small") == "full"
        for name, values, ids in type(self).tokenmill_kit_parameters(full):
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, values, ids=ids)
