"""Running kit cases in a child pytest, for what must not leak into the parent session.

``TRITON_INTERPRET=1`` is read when triton is first imported, and a whole test session
imports triton long before a given module runs; setting it in the parent would also make
every later Triton test interpret. A module that needs it runs its kit class in a child::

    class TestTritonConformance(AttentionBackendConformance):
        backend_name = "triton"
        required_env = {"TRITON_INTERPRET": "1"}   # skipped in the parent

    def test_conformance_under_the_interpreter():
        run_pytest_child(f"{__file__}::TestTritonConformance", env={"TRITON_INTERPRET": "1"})
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

CHILD_TIMEOUT_S = 600


def run_pytest_child(*targets: str, env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                     timeout: float = CHILD_TIMEOUT_S) -> str:
    """Run ``python -m pytest -p tokenmill.testing <targets>`` with ``env`` added to this
    process's environment (``PYTHONPATH`` passes on, with the parent's ``sys.path`` after
    it so the child imports the same packages); fail with the child's output unless every
    selected test passed. Returns the output. A child in which every case skipped fails
    too: that is a misconfiguration (the env did not reach it), not a pass."""
    import pytest

    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in [child_env.get("PYTHONPATH", ""), *sys.path] if p)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tokenmill.testing", "-p", "no:cacheprovider",
               "-rs", *extra_args, *targets]
    done = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"child pytest {' '.join(targets)} exited with {done.returncode}:\n{output[-6000:]}",
                    pytrace=False)
    if " passed" not in output:
        pytest.fail(f"child pytest {' '.join(targets)} passed nothing (all skipped?):\n{output[-6000:]}", pytrace=False)
    return output
