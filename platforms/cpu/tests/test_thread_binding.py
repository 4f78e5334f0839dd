"""The claiming pool's thread binding (kernels/thread_binding.h, ``TOKENMILL_CPU_BIND``): it follows
the affinity mask and the cgroup quota, as the pool reports it and as the OS sees it
(``/proc/self/task/<tid>/status``). Each case whose mask differs from this session's runs the CPU
platform in a child process (thread_binding_probe.py). No timing is asserted: whether binding
pays is measured by ``tokenmill bench throughput --background-load N``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from thread_binding_probe import allowed_cores

from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")

PROBE = Path(__file__).with_name("thread_binding_probe.py")
MASK = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(MASK) < 2, reason="needs two cores in the affinity mask")


def _probe(*args: str, bind: str | None = None, threads: int | None = None) -> dict:
    """The probe's report; the engine's threads from the mask and quota unless ``threads``."""
    env = {k: v for k, v in os.environ.items() if k not in {"TOKENMILL_NUM_THREADS", "TOKENMILL_CPU_BIND"}}
    if bind is not None:
        env["TOKENMILL_CPU_BIND"] = bind
    if threads is not None:
        env["TOKENMILL_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, str(PROBE), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pinned_apart(pool: dict) -> None:
    """Each worker on its own planned core, by the pool's word and the OS's; the caller left free."""
    assert pool["worker_cores"] == pool["cores"][1:pool["threads"]]
    assert pool["worker_allowed"] == [[core] for core in pool["worker_cores"]]
    assert len(set(pool["cores"])) == len(pool["cores"]) == pool["threads"]
    assert pool["caller_allowed"] == pool["process_mask"]


def test_a_one_core_mask_runs_one_thread_there():
    core = MASK[-1]
    pool = _probe("--mask", str(core))
    assert pool["threads"] == 1 and pool["workers"] == 0
    assert pool["mask"] == pool["cores"] == [core]
    assert pool["caller_allowed"] == [core]  # the mask, not the pool, holds the caller there


@needs_two_cores
def test_the_whole_mask_runs_a_thread_on_each_of_its_cores():
    pool = _probe()
    assert pool["binding"] == "auto" and pool["threads"] == len(MASK) and pool["workers"] == len(MASK) - 1
    assert pool["mask"] == pool["cores"] == MASK
    _pinned_apart(pool)


@needs_two_cores
def test_a_cgroup_quota_of_one_core_runs_one_thread_and_pins_nothing(tmp_path):
    """A quota is CPU time, not cores: fewer threads than the mask's cores are left to the scheduler."""
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    pool = _probe("--cgroup-root", str(tmp_path))
    assert pool["threads"] == 1 and pool["workers"] == 0 and pool["cores"] == []
    assert pool["caller_allowed"] == MASK


@needs_two_cores
def test_off_pins_nothing():
    pool = _probe(bind="off")
    assert pool["binding"] == "off" and pool["threads"] == len(MASK) and pool["cores"] == []
    assert pool["worker_cores"] == [-1] * (len(MASK) - 1)
    assert pool["worker_allowed"] == [MASK] * (len(MASK) - 1)


@needs_two_cores
def test_a_listed_binding_keeps_the_listed_order_and_drops_cores_outside_the_mask():
    listed = [*reversed(MASK), MASK[-1] + 1]  # the last one is not in the mask
    pool = _probe(bind=",".join(map(str, listed)), threads=len(MASK) + 1)
    assert pool["threads"] == len(MASK) and pool["cores"] == list(reversed(MASK))  # one thread per core left
    _pinned_apart(pool)


def test_more_threads_than_cores_are_capped_and_a_forked_child_binds_against_its_own_mask():
    """The parent, on one core, runs one thread whatever it was asked for; its child, given two
    cores, starts its own pool and pins its worker to the core the parent did not have."""
    first = MASK[0]
    wider = MASK[:2]
    pool = _probe("--mask", str(first), "--fork-mask", ",".join(map(str, wider)), threads=2)
    assert pool["threads"] == 1 and pool["workers"] == 0 and pool["cores"] == [first]
    child = pool["child"]
    assert child["mask"] == child["process_mask"] == wider
    assert child["threads"] == len(wider) and child["cores"] == wider
    if len(wider) == 2:
        assert child["worker_tids"] and not set(child["worker_tids"]) & set(pool["worker_tids"])
        _pinned_apart(child)


@needs_two_cores
def test_binding_changes_where_a_kernel_runs_never_its_result(tmp_path):
    outputs = {}
    for bind in ("auto", "off"):
        _probe("--outputs", str(tmp_path / bind), bind=bind)
        outputs[bind] = torch.load(tmp_path / bind)
    for pinned, free in zip(outputs["auto"], outputs["off"], strict=True):
        assert torch.equal(pinned, free)


@pytest.fixture
def kernels() -> Iterator[object]:
    """This session's kernels on every core of the mask, the binding restored afterwards."""
    kernels = load_kernels()
    threads, binding = kernels.pool_threads(), kernels.thread_binding()
    kernels.set_pool_threads(len(MASK))
    yield kernels
    kernels.set_thread_binding(binding)
    kernels.set_pool_threads(threads)


def _run_a_region(kernels) -> dict:
    CpuLayerOps(kernels, packed_budget=0).rms_norm(torch.randn(300, 768), torch.randn(768), 1e-6)
    return kernels.thread_pool_stats()


@needs_two_cores
def test_a_new_setting_pins_and_unpins_the_running_workers(kernels):
    kernels.set_thread_binding("off")
    pool = _run_a_region(kernels)
    assert pool["cores"] == [] and all(core == -1 for core in pool["worker_cores"])
    assert all(allowed_cores(tid) == MASK for tid in pool["worker_tids"])
    kernels.set_thread_binding("auto")
    pool = _run_a_region(kernels)
    assert pool["cores"] == MASK and pool["worker_cores"][:len(MASK) - 1] == MASK[1:]
    assert [allowed_cores(tid) for tid in pool["worker_tids"][:len(MASK) - 1]] == [[core] for core in MASK[1:]]


@pytest.mark.parametrize("setting", ["", "AUTO", "off", "nobind", "0", "0-1", " 1, 0 "])
def test_well_formed_settings_are_taken(kernels, setting):
    kernels.set_thread_binding(setting)
    assert kernels.thread_binding() in {"auto", "off", setting.strip()}


@pytest.mark.parametrize("setting", ["on", "0,", "1-0", "-1", "0-x", "1,,2"])
def test_malformed_settings_are_refused_and_the_old_one_kept(kernels, setting):
    kernels.set_thread_binding("off")
    with pytest.raises(RuntimeError, match="TOKENMILL_CPU_BIND"):
        kernels.set_thread_binding(setting)
    assert kernels.thread_binding() == "off"


def test_a_malformed_environment_setting_fails_at_start_up():
    env = {**os.environ, "TOKENMILL_CPU_BIND": "cores 0 and 1"}
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "TOKENMILL_CPU_BIND" in done.stderr
