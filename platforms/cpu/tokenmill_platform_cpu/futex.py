"""Sleeping until a 32-bit word in shared memory changes (Linux futexes, through ctypes).

A rank waiting in a shared-memory collective for a peer that is not running (descheduled on a
busy machine, or sharing the waiter's core) must leave the core, and must wake the moment the
peer posts, as a blocking socket read does: a sleep of fixed length would add up to its length
to every collective. ``FUTEX_WAIT`` on the peer's sequence number sleeps only while the word
still holds the value the waiter saw (the kernel checks, so a post between the read and the
call is never missed); the peer's ``FUTEX_WAKE`` after its post ends the sleep. The word lives
in a ``MAP_SHARED`` mapping, so the futexes are the shared kind (no ``FUTEX_PRIVATE_FLAG``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "i386": 240, "i686": 240}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def futex_available() -> bool:
    return _libc is not None and _SYS_FUTEX is not None


def futex_wait(address: int, expected: int, timeout_seconds: float) -> None:
    """Sleep while the int32 at ``address`` is ``expected``: until a wake, a signal, or
    ``timeout_seconds``. Returns at once when it already differs. The GIL is released (ctypes)."""
    assert _libc is not None and _SYS_FUTEX is not None
    seconds = int(timeout_seconds)
    timeout = _Timespec(seconds, int((timeout_seconds - seconds) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(timeout), None, 0)  # EAGAIN, ETIMEDOUT, EINTR: the caller looks again


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    assert _libc is not None and _SYS_FUTEX is not None
    if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
