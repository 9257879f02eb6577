"""Start N worker actors on a placement group and wire them into one collective group.

The placement group has one bundle per worker (CPUs, and one GPU each with use_gpu). The
collective group is a torch ProcessGroup object per actor (comm/group.py) that meets at a
TCPStore on rank 0's node; Ray tells every rank where that is.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zeroray.config import ScalingConfig
from zeroray.runtime.worker import Worker

log = logging.getLogger("zeroray")


class PlacementError(RuntimeError):
    pass


def ensure_ray(scaling: ScalingConfig) -> None:
    """Start a local embedded Ray when none is running, sized so the workers fit (oversubscribed)."""
    if ray.is_initialized():
        return
    import os

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    cpus = max(os.cpu_count() or 1, 8, int(scaling.num_workers * scaling.cpus_per_worker + 0.999))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING, configure_logging=True)


def _cluster_offer() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    return (f"the cluster has CPU {total.get('CPU', 0):g} (free {free.get('CPU', 0):g}), "
            f"GPU {total.get('GPU', 0):g} (free {free.get('GPU', 0):g}) on {len(ray.nodes())} node(s)")


class WorkerGroup:
    """The actors of one training run (one world size); torn down and rebuilt on resize/recovery."""

    def __init__(self, spec: Dict[str, Any], num_workers: int, scaling: ScalingConfig) -> None:
        self.num_workers = num_workers
        self.pg = None
        self.actors: List[Any] = []
        bundle = {"CPU": scaling.cpus_per_worker}
        if scaling.use_gpu:
            bundle["GPU"] = 1
        self.pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=scaling.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=scaling.placement_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise PlacementError(
                f"could not place {num_workers} worker(s) of {bundle} with strategy {scaling.placement_strategy} "
                f"within placement_timeout_s={scaling.placement_timeout_s:g}: {_cluster_offer()}. Ask for fewer "
                "workers (ScalingConfig.num_workers), fewer CPUs per worker (cpus_per_worker), or add nodes.")
        threads = scaling.threads_per_worker or max(1, int(scaling.cpus_per_worker))
        actor_cls = ray.remote(Worker)
        try:
            for rank in range(num_workers):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                            placement_group_bundle_index=rank)
                self.actors.append(actor_cls.options(
                    num_cpus=scaling.cpus_per_worker, num_gpus=1 if scaling.use_gpu else 0,
                    scheduling_strategy=strategy, max_concurrency=2, max_restarts=0,
                    name=None).remote(rank, num_workers, threads, scaling.use_gpu))
            self.nodes = ray.get([a.node_info.remote() for a in self.actors])
            master_addr = self.nodes[0]["ip"]
            master_port = ray.get(self.actors[0].free_port.remote())
            spec = dict(spec, group_name=f"zr-{uuid.uuid4().hex[:8]}")
            self.setup_info = ray.get([a.setup.remote(spec, master_addr, master_port) for a in self.actors])
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any, ranks: Optional[Sequence[int]] = None, **kwargs: Any) -> List[Any]:
        """Start ``method`` on every actor (or ``ranks``); returns object refs."""
        actors = self.actors if ranks is None else [self.actors[r] for r in ranks]
        return [getattr(a, method).remote(*args, **kwargs) for a in actors]

    def call_each(self, method: str, per_rank_args: Sequence[Sequence[Any]]) -> List[Any]:
        return [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def wait_all(self, refs: List[Any], timeout_s: Optional[float], what: str) -> List[Any]:
        """ray.get with a deadline that names the workers that did not finish."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 1.0) if left is not None else 1.0)
            for ref in done:
                ray.get(ref)  # raises the worker's error (or RayActorError) at once
            if pending and deadline is not None and time.monotonic() >= deadline:
                late = [refs.index(r) for r in pending]
                raise TimeoutError(f"{what}: worker(s) {late} did not finish within {timeout_s:g} s "
                                   "(collective_timeout_s); a collective is stuck or a worker is hung")
        return ray.get(refs)
