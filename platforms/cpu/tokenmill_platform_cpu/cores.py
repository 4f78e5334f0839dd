"""How many cores this process may really use: its CPU affinity, capped by a
cgroup CPU quota (containers), never the host's core count."""

from __future__ import annotations

import math
import os
from pathlib import Path


def affinity_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota in cores (cgroup v2 ``cpu.max`` or v1 ``cfs_quota``), or None."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    v1_quota, v1_period = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
    if v1_quota.is_file() and v1_period.is_file():
        microseconds = int(v1_quota.read_text())
        if microseconds > 0:
            return microseconds / int(v1_period.read_text())
    return None


def usable_cores(root: Path = Path("/sys/fs/cgroup")) -> int:
    cores = affinity_cores()
    quota = cgroup_quota_cores(root)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)
