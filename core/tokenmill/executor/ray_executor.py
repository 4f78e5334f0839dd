"""The Ray executor ("ray"): one Ray actor per rank, placed with a placement group.

The same workers and the same ``collective_rpc`` contract as the "mp" executor, for ranks
that may live on other machines: each actor (:class:`RayRank`) holds one
:class:`~tokenmill.worker.worker.Worker` built from ``spec.for_rank(rank)``; rank 0's actor
names a TCP address on its node, and every actor joins the ``torch.distributed`` group there
with the platform's backend (gloo on the CPU, NCCL on CUDA) before building its worker. A
call is one actor method call per rank; Ray runs one caller's calls on an actor in order.

It attaches to the Ray cluster this process is connected to, else to ``RAY_ADDRESS``, else
starts a local one (and stops it on shutdown). Ray stays optional: ``pip install tokenmill[ray]``.

Failure, not hangs: the answers are awaited in short ``ray.wait`` polls, so the first rank
whose actor died or whose call raised fails the call with :class:`WorkerFailure` naming it
(the others may be stuck in a collective with it), and every actor is killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenmill.executor.multiproc import free_port, rank_threads
from tokenmill.executor.remote_ranks import RemoteRanksExecutor
from tokenmill.platform import Platform
from tokenmill.worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # how often a waiting call looks for a failed rank
DEATH_GRACE_SECONDS = 3.0  # how long a rank's error waits for a peer to show as dead (the cause)
START_TIMEOUT_SECONDS = 300.0  # for the placement group's resources to be reserved


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]'") from exc
    return ray


class RayRank:
    """One rank, inside a Ray actor: joins the group, builds its worker, answers calls."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.worker: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0's rendezvous store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, backend: str, address: str, port: int) -> None:
        import torch.distributed as dist

        from tokenmill.worker.worker import Worker

        spec = self.spec
        os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(spec.world_size))
        dist.init_process_group(backend=backend, init_method=f"tcp://{address}:{port}", rank=spec.rank,
                                world_size=spec.world_size)
        self.worker = Worker(spec)

    def execute_method(self, method: str | Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any] | None) -> Any:
        return self.worker.execute_method(method, args, kwargs)


class RayExecutor(RemoteRanksExecutor):
    """``spec.config.world_size`` Ray actors, one bundle each of a placement group (a GPU per
    bundle where the platform has a device per rank, else CPUs: each rank's thread share)."""

    def __init__(self, spec: WorkerSpec, platform: Platform | None = None, **worker_args: Any) -> None:
        super().__init__(spec)
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        world_size = spec.config.world_size
        self.owns_cluster = not ray.is_initialized()
        if self.owns_cluster:  # RAY_ADDRESS, where set, names the cluster to join (ray.init reads it)
            ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else os.cpu_count(), include_dashboard=False,
                     log_to_driver=False)
        backend = platform.dist_backend if platform is not None else "gloo"
        on_gpus = getattr(platform, "device_type", "cpu") == "cuda"
        threads = rank_threads(spec, world_size)
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpus else {"CPU": float(threads)}
        self.group = placement_group([dict(bundle)] * world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop_actors, ray, self.actors, self.group, remove_placement_group,
                                           self.owns_cluster)
        try:
            ray.get(self.group.ready(), timeout=START_TIMEOUT_SECONDS)
            config = spec.config.model_copy(update={"num_threads": threads})
            actor_class = ray.remote(RayRank)
            for rank in range(world_size):
                rank_spec = WorkerSpec(spec.model_path, config, spec.dtype, spec.max_model_len, spec.plugins,
                                       world_size=world_size).for_rank(rank, local_rank=0 if on_gpus else rank)
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                            placement_group_bundle_index=rank)
                self.actors.append(actor_class.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy,
                    name=None).remote(rank_spec))
            address, port = ray.get(self.actors[0].rendezvous_address.remote())
            self._start_collecting("tokenmill-ray-collect")
            self._gather([actor.start.remote(backend, address, port) for actor in self.actors])
        except BaseException:
            self._finalizer()
            raise
        logger.info("ray executor: %d actors over %s at %s:%d", world_size, backend, address, port)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       ) -> Any:  # list[Any] | Future[list[Any]], as the overloads say
        refused = self._refuse_after_failure(non_block)
        if refused is not None:
            return refused
        with self._send_lock:  # the calls reach every actor in one order
            refs = [actor.execute_method.remote(method, args, kwargs) for actor in self.actors]
            future: Future[list[Any]] = self._collector.submit(self._gather, refs)
        return future if non_block else future.result()

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's answer, in rank order; the first rank to fail fails the call."""
        ray = self._ray
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(f"worker rank {refs.index(ref)} (Ray actor) died: {exc}")
                except ray.exceptions.RayError as exc:
                    # A rank that died explains the others' failed collectives best; Ray reports
                    # its death a moment after its peers see its sockets close.
                    self._fail_for_a_death(refs, DEATH_GRACE_SECONDS)
                    self._fail(f"worker rank {refs.index(ref)} raised:\n{exc}")
        return list(ray.get(refs))

    def _fail_for_a_death(self, refs: list[Any], grace: float) -> None:
        """Fail naming the first rank whose actor shows as dead within ``grace`` seconds, if any."""
        ray = self._ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace)
        for rank, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._fail(f"worker rank {rank} (Ray actor) died: {exc}")
            except ray.exceptions.RayError:
                pass


def _stop_actors(ray: Any, actors: list[Any], group: Any, remove_placement_group: Callable[[Any], None],
                 owns_cluster: bool) -> None:
    """Kill every actor (its process goes with it), free the placement group, and stop the
    local cluster this executor started."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        remove_placement_group(group)
    if owns_cluster:
        with contextlib.suppress(Exception):
            ray.shutdown()
