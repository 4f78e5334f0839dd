"""Whether a process runs, by pid: for code that watches peers it did not start itself (a
tensor-parallel rank's collective waiting on the others), where no ``Process`` handle exists."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie (dead, not yet reaped by its parent) does not: it will never
    answer, and its pid stays taken until the parent waits for it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal-0 probe (a zombie still counts as alive there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # it exists, as another user's
            return True
        return True
