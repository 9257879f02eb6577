"""Start N worker actors on a placement group and wire them into one collective group.

The placement group has one bundle per worker (CPUs, and one GPU each with use_gpu). The
collective group is a torch ProcessGroup object per actor (comm/group.py) that meets at a
TCPStore on rank 0's node; Ray tells every rank where that is.

The group's concerns have files of their own: placement.py (placement groups, actors, spares:
[Note: spare placement]), failure_detection.py (``wait_all``: [Note: failure detection]) and
reform.py (``replace``, ``shrink``: [Note: replace, don't restart], [Note: shrink in memory],
[Note: rendezvous timeout]); ``WorkerGroup`` is made of them.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, List, Optional, Sequence

import ray
from ray.util.placement_group import remove_placement_group

from zeroray.config import ScalingConfig
from zeroray.runtime.failures import setup_error
from zeroray.runtime.records import NodeInfo, SetupInfo, WorkerSpec
from zeroray.runtime.worker.actor import CONCURRENCY_GROUPS, Worker
from zeroray.runtime.worker.sequencer import Ticket
from zeroray.runtime.worker_group.failure_detection import FailureDetection
from zeroray.runtime.worker_group.placement import Placement, kill
from zeroray.runtime.worker_group.reform import REFORM_RENDEZVOUS_S, Reform
from zeroray.runtime.worker_group.spares import Slot


class WorkerGroup(Placement, Reform, FailureDetection):
    """The actors of one world size, placed and wired into one collective group.

    Torn down and rebuilt on recovery; on resize a new group is built next to the old one.
    Every call that touches the engines goes through ``call``, which numbers it per
    worker ([Note: one engine call at a time] in worker/sequencer.py); ``poll`` calls never wait for
    the engines. ``wait_all`` collects one call per worker and says who failed and how.
    """

    def __init__(self, spec: WorkerSpec, num_workers: int, scaling: ScalingConfig, spares: int = 0,
                 start_spares: bool = True) -> None:
        self.num_workers = num_workers
        self.pg = None
        self.actors: List[Any] = []
        self.nodes: List[NodeInfo] = []
        self.failed: Optional[str] = None  # why the group was torn down after a failure
        # [Note: replace, don't restart]: kill only the lost workers on a failure (set during a
        # fit with snapshots); ``survivors`` are the ranks kept, until ``replace`` or ``shutdown``.
        self.keep_survivors = False
        self.survivors: List[int] = []
        self.spares: List[Any] = []  # warm actors, each (actor, its slot, its warm call)
        self._spare_count = spares  # how many spares to keep
        # [Note: spare placement]: with spares, every rank and spare holds a placement group of
        # one bundle, so that a spare's reservation is released on its own.
        self._singles = spares > 0
        self._pgs: List[Any] = []  # every placement group this group holds (removed by shutdown)
        self.scaling, self._threads = scaling, scaling.threads_per_worker or max(1, int(scaling.cpus_per_worker))
        self._actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Worker)  # once: every actor, spares too
        self.collective_timeout_s = spec.zero.collective_timeout_s
        # [Note: rendezvous timeout]: how long joining a re-formed group may take
        self.rendezvous_timeout_s = min(REFORM_RENDEZVOUS_S, self.collective_timeout_s)
        self._spec = spec  # what a spare warms up for
        self._next_seq = [0] * num_workers  # per worker: the number of its next engine call
        self._numbering = threading.Lock()  # driver threads (a fit, a report) may call at once
        self._bundle = {"CPU": scaling.cpus_per_worker}
        if scaling.use_gpu:
            self._bundle["GPU"] = 1
        t0 = time.monotonic()
        # per rank: its slot, (placement group, bundle index); None: outside any placement group
        self.bundles: List[Optional[Slot]] = self._reserve(num_workers)
        self.timings = {"placement_s": time.monotonic() - t0}  # where the start-up time goes
        try:
            for rank in range(num_workers):
                self.actors.append(self._new_actor(rank, self.bundles[rank]))
            self.nodes = ray.get(self.poll("node_info"))
            self.timings["actors_s"] = time.monotonic() - t0 - self.timings["placement_s"]
            master_addr = self.nodes[0].ip
            master_port = ray.get(self.poll("free_port", ranks=[0]))[0]
            spec = spec.in_group(f"zr-{uuid.uuid4().hex[:8]}")
            self.setup_info: List[SetupInfo] = ray.get(self.call("setup", spec, master_addr, master_port))
            self.timings["setup_s"] = time.monotonic() - t0 - self.timings["placement_s"] - self.timings["actors_s"]
            self.timings["rendezvous_s"] = max(i.rendezvous_s for i in self.setup_info)  # parts of setup_s
            self.timings["build_s"] = max(i.build_s for i in self.setup_info)
        except BaseException as error:
            self.shutdown()
            if isinstance(error, ray.exceptions.RayTaskError):
                raise setup_error(error) from error
            raise
        if start_spares:  # after the group: they do not slow its start
            self.start_spares()

    def hold_copies(self, shard_refs: Sequence[Any]) -> int:
        """Have a buddy on another node copy each rank's snapshot shard ([Note: buddy copies] in
        snapshot.py): rank r's buddy is the next rank after r on another node; none on one node.
        Not waited for. Returns how many copies were asked for."""
        asked = 0
        for rank, buddy in enumerate(buddies([node.node_id for node in self.nodes])):
            if buddy is not None and shard_refs[rank] is not None:
                self.actors[buddy].hold_copy.remote([shard_refs[rank]])
                asked += 1
        return asked

    # --- calls -----------------------------------------------------------------------------

    def call(self, method: str, *args: Any, per_rank: Optional[Sequence[Sequence[Any]]] = None,
             ranks: Optional[Sequence[int]] = None, after_ok: bool = False, num_returns: int = 1) -> List[Any]:
        """Start engine call ``method`` on every actor (or ``ranks``), each in its turn; object refs
        in rank order. Every worker gets ``args``, or with ``per_rank`` its own: ``per_rank[i]`` for
        ``ranks[i]``. ``after_ok``: skip it (it returns Cancelled) where the call before it failed."""
        self._check_usable()
        ranks = range(self.num_workers) if ranks is None else ranks
        if per_rank is None:
            per_rank = [args] * len(ranks)
        elif args:
            raise TypeError("call: give the workers args, or per_rank args, not both")
        refs = []
        with self._numbering:  # one call's tickets at a time, so every worker runs calls in one order
            for rank, rank_args in zip(ranks, per_rank):
                ticket = Ticket(self._next_seq[rank], after_ok)
                self._next_seq[rank] += 1
                remote = getattr(self.actors[rank], method)
                if num_returns != 1:
                    remote = remote.options(num_returns=num_returns)
                refs.append(remote.remote(ticket, *rank_args))
        return refs

    def poll(self, method: str, ranks: Optional[Sequence[int]] = None) -> List[Any]:
        """Start a poll (``node_info``, ``free_port``, ``progress``): answered even during a step."""
        ranks = range(self.num_workers) if ranks is None else ranks
        return [getattr(self.actors[r], method).remote() for r in ranks]

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"this worker group failed and was shut down ({self.failed}); build a new Trainer, "
                               "or zr.Trainer.restore(...) from a checkpoint (fit does this by itself with "
                               "FailureConfig(max_failures>0) and CheckpointConfig(every_steps=...))")

    def shutdown(self) -> None:
        """Kill the actors and spares, remove the placement groups (no call of theirs is waited for)."""
        self.survivors = []
        for actor in self.actors + [a for a, _, _ in self.spares]:
            kill(actor)
        self.actors, self.spares = [], []
        pgs, self._pgs, self.pg = self._pgs, [], None
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass


def buddies(node_ids: List[str]) -> List[Optional[int]]:
    """Per rank, its buddy ([Note: buddy copies] in snapshot.py): the first rank after it (cyclically) whose
    worker runs on another node; None where every other rank shares its node."""
    n = len(node_ids)
    return [next(((r + k) % n for k in range(1, n) if node_ids[(r + k) % n] != node_ids[r]), None)
            for r in range(n)]
