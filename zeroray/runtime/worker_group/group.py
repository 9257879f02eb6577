"""Start N worker actors on a placement group and wire them into one collective group.

The placement group has one bundle per worker (CPUs, and one GPU each with use_gpu). The
collective group is a torch ProcessGroup object per actor (comm/group.py) that meets at a
TCPStore on rank 0's node; Ray tells every rank where that is.

``WorkerGroup`` holds the actors by rank, numbers their calls and waits for them. Its
collaborators have files of their own, each the only writer of its state: ``Placement``
(placement.py: the placement groups, each rank's slot, the spares: [Note: spare placement]) and
``FailureDetector`` (failure_detection.py: who failed and how: [Note: failure detection]). A
re-form after a failure (reform.py: ``replace``, ``shrink``: [Note: replace, don't restart],
[Note: shrink in memory], [Note: rendezvous timeout]) works on the group through the methods below.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import ray

from zeroray.config import ScalingConfig
from zeroray.runtime.failures import ErrorKind, classify_error, setup_error
from zeroray.runtime.records import NodeInfo, SetupInfo, WorkerSpec
from zeroray.runtime.worker.sequencer import Ticket
from zeroray.runtime.worker_group.failure_detection import FAILURE_GRACE_S, FailureDetector
from zeroray.runtime.worker_group.placement import Placement, kill

log = logging.getLogger("zeroray")

# The rendezvous of a re-form (its store and connections), not its collectives: see [Note:
# rendezvous timeout] in reform.py.
REFORM_RENDEZVOUS_S = 3.0


class WorkerGroup:
    """The actors of one world size, placed and wired into one collective group.

    Torn down and rebuilt on recovery; on resize a new group is built next to the old one.
    Every call that touches the engines goes through ``call``, which numbers it per
    worker ([Note: one engine call at a time] in worker/sequencer.py); ``poll`` calls never wait for
    the engines. ``wait_all`` collects one call per worker and says who failed and how.
    """

    def __init__(self, spec: WorkerSpec, num_workers: int, scaling: ScalingConfig, spares: int = 0,
                 start_spares: bool = True) -> None:
        self.num_workers = num_workers
        self.scaling = scaling
        self.actors: List[Any] = []
        self.nodes: List[NodeInfo] = []
        self.failed: Optional[str] = None  # why the group was torn down after a failure
        # [Note: replace, don't restart]: kill only the lost workers on a failure (set during a
        # fit with snapshots); ``survivors`` are the ranks kept, until a re-form or ``shutdown``.
        self.keep_survivors = False
        self.survivors: List[int] = []
        # [Note: rendezvous timeout]: how long joining a re-formed group may take
        self.rendezvous_timeout_s = min(REFORM_RENDEZVOUS_S, spec.zero.collective_timeout_s)
        self.detector = FailureDetector(spec.zero.collective_timeout_s, self.rendezvous_timeout_s)
        self.placement = Placement(spec, scaling, spares)
        self._next_seq = [0] * num_workers  # per worker: the number of its next engine call
        self._numbering = threading.Lock()  # driver threads (a fit, a report) may call at once
        t0 = time.monotonic()
        self.placement.reserve(num_workers)
        self.timings = {"placement_s": time.monotonic() - t0}  # where the start-up time goes
        try:
            for rank in range(num_workers):
                self.actors.append(self.placement.new_actor(rank))
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
            self.placement.start_spares()

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

    def wait_all(self, refs: List[Any], timeout_s: Optional[float], what: str,
                 ranks: Optional[Sequence[int]] = None, lockstep: bool = False,
                 independent: bool = False, grace_s: float = FAILURE_GRACE_S) -> List[Any]:
        """ray.get of one call per worker (refs in the order of ``ranks``, default all), failing fast
        and saying who failed.

        See [Note: failure detection]. Returns the results in order, or raises: the worker's own
        error ([Note: worker errors on the driver] in failures.py), WorkerDiedError,
        CollectiveTimeoutError or WorkerGroupError. After anything that leaves the workers out of
        step with each other (a death, a hung collective, an error on some ranks while others
        still wait in a collective) the group is shut down first, so nothing stays blocked. An
        error every worker raised together (the engine's step outcome) leaves the group usable.
        ``lockstep``: the calls are one collective step, so a user error on some workers while
        others succeeded also leaves them out of step (one applied the step, one did not).
        ``independent``: the calls run no collective (a save), so after an error in one the others
        are waited for to the end, not suspected of waiting in a collective; only a death cuts short.
        """
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = dict(zip(refs, ranks))
        results: Dict[int, Any] = {}
        errors: Dict[int, BaseException] = {}
        pending = list(refs)
        first_error_at = None
        while pending:
            now = time.monotonic()
            grace = first_error_at is not None and (not independent or any(
                classify_error(e) is ErrorKind.DIED for e in errors.values()))
            if grace and now - first_error_at >= grace_s:
                break
            if deadline is not None and now >= deadline:
                break
            wait_s = 1.0 if deadline is None else min(1.0, deadline - now)
            if grace:
                wait_s = min(wait_s, grace_s - (now - first_error_at))
            done, pending = ray.wait(pending, num_returns=1, timeout=max(wait_s, 0.01))
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - judged below
                    errors[rank_of[ref]] = error
                    if first_error_at is None:
                        first_error_at = time.monotonic()
        if not errors and not pending:
            return [results[r] for r in ranks]
        verdict = self.detector.judge(errors, [rank_of[r] for r in pending], what,
                                      succeeded=sorted(results) if lockstep else [], answered=sorted(results),
                                      actors=self.actors, nodes=self.nodes, keep_survivors=self.keep_survivors)
        if verdict.reason is not None:
            self.tear_down(verdict.reason, verdict.keep)
        raise verdict.error

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

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"this worker group failed and was shut down ({self.failed}); build a new Trainer, "
                               "or zr.Trainer.restore(...) from a checkpoint (fit does this by itself with "
                               "FailureConfig(max_failures>0) and CheckpointConfig(every_steps=...))")

    # --- after a failure: what a re-form (reform.py) does to the group --------------------------

    def tear_down(self, reason: str, alive: Sequence[int] = ()) -> None:
        """Mark the group failed and kill its workers; with ``keep_survivors``, the ``alive`` ones
        (their call came back) stay for a re-form ([Note: replace, don't restart] in reform.py)."""
        self.failed = reason
        if self.keep_survivors and alive:
            log.warning("zeroray: %s; keeping worker(s) %s, replacing the others", reason, list(alive))
            self.survivors = list(alive)
            for rank, actor in enumerate(self.actors):
                if rank not in self.survivors:
                    kill(actor)
            return
        log.warning("zeroray: %s; shutting the worker group down", reason)
        self.shutdown()

    def seat(self, rank: int, actor: Any) -> None:
        """Put a new worker (a spare, or a new actor) in lost rank ``rank``; its calls count from 0."""
        self.actors[rank] = actor
        self._next_seq[rank] = 0

    def keep_only(self, ranks: Sequence[int]) -> None:
        """Shrink to the workers of ``ranks`` (sorted), renumbered in that order; the others are
        killed and their slots released ([Note: shrink in memory] in reform.py)."""
        for rank, actor in enumerate(self.actors):
            if rank not in ranks:
                kill(actor)
        self.placement.keep_only(ranks)
        self.actors = [self.actors[r] for r in ranks]
        self._next_seq = [self._next_seq[r] for r in ranks]
        self.num_workers = len(ranks)

    def rejoin(self, spec: WorkerSpec, nodes: List[NodeInfo], master_port: int) -> None:
        """Every worker (on ``nodes``) joins a new collective group of the group's size, at rank 0's
        ``master_port``, and builds its engine again; its rendezvous may take rendezvous_timeout_s
        ([Note: rendezvous timeout] in reform.py). The group is usable again once it returns; a
        failure raises as ``wait_all`` does (the group is broken again)."""
        self.nodes, self.failed, self.survivors = nodes, None, []
        spec = spec.in_group(f"zr-{uuid.uuid4().hex[:8]}")
        joining = self.rendezvous_timeout_s
        self.setup_info = self.wait_all(self.call("setup", per_rank=[(spec, nodes[0].ip, master_port, r,
                                                                      self.num_workers, joining)
                                                                     for r in range(self.num_workers)]),
                                        None, "re-form the group", grace_s=2 * joining + FAILURE_GRACE_S)

    # --- where the workers are: the placement's (placement.py), read here ----------------------

    @property
    def pg(self) -> Any:
        """The placement group every rank's bundle is in, when they share one of zeroray's own."""
        return self.placement.pg

    @property
    def spares(self) -> List[Any]:
        """The warm spares, each (actor, its slot, its warm call): [Note: spare placement]."""
        return self.placement.spares

    def spares_warm(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` for every spare to be started and warm; whether they are."""
        return self.placement.spares_warm(timeout_s)

    def shutdown(self) -> None:
        """Kill the actors and spares, remove the placement groups (no call of theirs is waited for)."""
        self.survivors = []
        for actor in self.actors:
            kill(actor)
        self.actors = []
        self.placement.close()


def buddies(node_ids: List[str]) -> List[Optional[int]]:
    """Per rank, its buddy ([Note: buddy copies] in snapshot.py): the first rank after it (cyclically) whose
    worker runs on another node; None where every other rank shares its node."""
    n = len(node_ids)
    return [next(((r + k) % n for k in range(1, n) if node_ids[(r + k) % n] != node_ids[r]), None)
            for r in range(n)]
