"""Start N worker actors on a placement group and wire them into one collective group.

The placement group has one bundle per worker (CPUs, and one GPU each with use_gpu). The
collective group is a torch ProcessGroup object per actor (comm/group.py) that meets at a
TCPStore on rank 0's node; Ray tells every rank where that is.

[Note: failure detection]
The driver waits for one call per worker (``wait_all``) with ``ray.wait`` in short polls and
looks at every result as soon as it arrives. A killed worker shows up twice, within about a
second: Ray fails the dead actor's call (RayActorError), and each survivor's gloo call fails
on the closed connection ("Connection reset by peer"). A rank that never reaches a collective
makes the others' gloo calls time out after ``collective_timeout_s``. After the first error
the driver listens ``_FAILURE_GRACE_S`` more for the rest, then decides: a death
(WorkerDiedError) wins over a broken connection (WorkerGroupError) or a timeout
(CollectiveTimeoutError, naming the ranks that issued fewer collectives: they did not
arrive); otherwise the failing worker's own error is raised (see failures.py), not the
``PeerStepError`` errors of the workers whose step was dropped because of it. Whenever the workers
are left out of step with each other, the driver kills them all (ray.kill) before raising:
survivors blocked in a collective are never waited for. An error that every worker raised
together (the engine's step outcome, see zeroray/errors.py) leaves the group usable. The
controller's recovery restarts on the first three kinds.

[Note: replace, don't restart]
While a fit keeps in-memory snapshots, the group is built with ``keep_survivors`` set: on one
of those three kinds of failure, the driver kills only the workers that are dead or did not
answer within the grace (hung, or blocked in a collective with a hung peer) and keeps the
others, the *survivors*, whose call came back with an error. ``replace`` then puts a worker in
each lost rank: a warm spare when there is one (``FailureConfig(spares=k)``: actors started
after the group, each in a placement group of its own ([Note: spare placement]), their Python,
torch and the lazy imports of a first build already loaded, so taking one costs no process
start), otherwise a new actor in the lost rank's bundle. Then every worker, survivors included,
joins a new collective group at the same size (a new rendezvous: the old group's connections
are broken) and builds its engine again in its own process. Survivors rebuild instead of
reusing their engine because the failed step may have stopped anywhere: inside a collective,
with buckets in flight, units gathered, gradients half reduced or the update half published; a
new engine from ``model_fn`` holds none of that. The controller then loads the snapshot into
every worker (the survivors roll back to it as well, since their step may have half-applied),
so at most the failed step is redone. A spare taken is made good in the background, in the
bundle the lost worker left, once the group is re-formed (started sooner, its process start and
imports would slow the re-form, and where the lost worker's node died, take the CPU of the node
that joins before the replacement does). Which spare: a warm one (its ``warm`` call returned)
before a cold one, since a cold one still has its imports ahead of it, and a cold one before a
new actor, which has its process start ahead as well; a spare whose call failed, whose node is
gone or that no longer answers is dropped and started again. A lost rank whose bundle's node
died keeps that bundle, which Ray places again: a new actor outside the placement group was
tried and was slower on the local multi-node cluster (no CPU is free outside the group until a
node joins, and the bundle takes the new node first). When no replacement can be placed or
built, ``replace`` raises and the controller shrinks the group to its survivors ([Note: shrink
in memory]) where the scaling policy allows, or restarts the whole group as before.

[Note: shrink in memory]
A lost worker whose replacement cannot be placed within ``placement_timeout_s`` (its node
died and no other node has room for its bundle, and no spare is left) need not stop the run
until the cluster grows: where the survivors are at least ``ScalingConfig.min_workers``
(``ScalingPolicy.on_lost``), ``shrink`` keeps them, renumbered in rank order, and they join
a new collective group of their own number, each building its engine for the smaller world
(``Worker.setup``'s ``world_size``). The controller then loads the in-memory snapshot into
them as it does after a replacement: each worker fetches the old shards that hold its slices
of the new layout, the lost rank's included (from its buddy's copy where its node died), the
same range math as a resize ([Note: resize transfer] in state_transfer.py). So the state is
resharded from N to N-1 in memory, and at most the failed step is redone. Without snapshots
no survivor is kept, and where the snapshot is lost (a worker and its buddy both died) the
disk checkpoint is loaded into the shrunk group instead, as a restart does. The lost rank's
bundle in a shared placement group stays reserved, empty, until the group ends (Ray cannot
drop one bundle); with spares it was a placement group of its own and is removed. A lower
``min_workers`` than ``num_workers`` is what allows it: by default the group waits for its
full size, as before.

[Note: spare placement]
A spare must never stand in the way of the group it serves: a resize places its new group
next to the old one, and a bundle a spare holds is room the new group lacks (chaos seed 0 with
two spares: 2 workers and 2 spares on a 6-CPU cluster left 2 CPUs for a group of 3, and the
resize raised PlacementError). So a spare holds a placement group of one bundle, its own, which
``release_spares`` removes (the resize does so first, and starts spares again for the new group
once the old one is gone, or for the old one when the resize did not happen). A spare that takes
a lost rank takes its placement group along, and the lost worker's slot goes to the next spare;
so in a group with spares every rank, too, holds a placement group of one bundle, or the slot
a swap leaves in a shared group could not be released. The placement strategy still decides
where: the group places all its bundles in one placement group with the strategy, reads where
they landed, removes it and places one placement group per bundle on those nodes (Ray's soft
node hint: where a node has no room by then, Ray places the bundle elsewhere; without spares the
shared placement group stays, so a STRICT strategy is strict only without spares). Spares are
placed after the group is placed and built, so they queue behind it for resources.

[Note: rendezvous timeout]
A re-form is a new rendezvous (comm/group.py's ``make_torch_group``: a TCPStore on rank 0, then
gloo connecting every pair). Its survivors join at once; the replacement joins after its setup
starts. When the replacement dies before it joined (chaos's "replacement killed during
re-form"), the survivors wait in the rendezvous for a peer that never comes: bounded by the
collective timeout, they were still waiting when the driver's grace ended, were killed, and the
whole group restarted. So a re-form's rendezvous has a timeout of its own,
``rendezvous_timeout_s`` (``_REFORM_RENDEZVOUS_S``, at most the collective timeout), after which
each survivor's setup raises ``RendezvousError`` with its process intact (its state comes back
from the snapshot, as after any replacement); the collectives afterwards keep
``collective_timeout_s``. So that the timeout can be short, the rendezvous waits for no import:
the driver first waits for every new worker's ``warm`` call (a spare's warm-up, or a new actor's
imports of what setup imports). The driver waits for the survivors' errors (a grace of twice the
timeout: a TCPStore client retries its connection once, so a survivor gives up within about 2x)
and keeps them, the dead replacement is killed, and ``replace`` takes another replacement (a
spare, or a new actor) and re-forms again. The recovery stays one recovery (``trainer.recoveries``
has one record; ``attempts`` counts the replacements tried), while the FailurePolicy counts each
death, the replacement's included, against ``max_failures``, as a death during a restart always
was. The constant: once imports are out of it, a re-form's rendezvous is the setup call reaching
every worker and the TCP connections; tests/ray/test_reform_retry.py measured 0.0-0.75 s for it
(``rendezvous_s``) at load 4-16 on 2 cores, so 3 s leaves room for a loaded machine. A rendezvous
slower than that (no worker died) fails the re-form as a CollectiveTimeoutError that keeps every
worker (none is late: none holds a group yet): it counts as one failure and the re-form is tried
again (tests/ray/test_reform_retry.py stalls a replacement with SIGSTOP to show it). The first build of a group keeps
the collective timeout for its rendezvous: there every worker may still be importing, and a
failure restarts the whole group anyway.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zeroray.comm.group import RendezvousError
from zeroray.config import ScalingConfig
from zeroray.runtime.failures import (CollectiveTimeoutError, ErrorKind, PlacementError, WorkerDiedError,
                                      WorkerGroupError, classify_error, first_line, setup_error, worker_error)
from zeroray.runtime.records import NodeInfo, SetupInfo, WorkerSpec, node_list
from zeroray.runtime.sequencer import Ticket
from zeroray.runtime.snapshot import buddies
from zeroray.runtime.spares import Slot, drop_dead_spares, take_spare
from zeroray.runtime.worker import CONCURRENCY_GROUPS, ENGINE_THREADS, Worker

log = logging.getLogger("zeroray")

# How long wait_all keeps listening for the other workers after the first error: long enough
# for Ray to report a killed actor (well under a second), short enough to fail fast.
_FAILURE_GRACE_S = 3.0

# The rendezvous of a re-form (its store and connections), not its collectives: see [Note:
# rendezvous timeout].
_REFORM_RENDEZVOUS_S = 3.0


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


def _single(bundle: Dict[str, float], node_id: Optional[str]) -> Any:
    """A placement group of one bundle, on node ``node_id`` where it has room (a hint)."""
    return placement_group([dict(bundle)], strategy="STRICT_PACK", _soft_target_node_id=node_id)


def _wait_placed(pgs: Sequence[Any], deadline: float) -> None:
    """Wait until every placement group in ``pgs`` is placed; PlacementError at ``deadline``."""
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    if len(ready) < len(refs):
        raise PlacementError("not placed in time")


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def _cluster_offer() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    return (f"the cluster has CPU {total.get('CPU', 0):g} (free {free.get('CPU', 0):g}), "
            f"GPU {total.get('GPU', 0):g} (free {free.get('GPU', 0):g}) on {len(ray.nodes())} node(s)")


class WorkerGroup:
    """The actors of one world size, placed and wired into one collective group.

    Torn down and rebuilt on recovery; on resize a new group is built next to the old one.
    Every call that touches the engines goes through ``call``/``call_each``, which number it per
    worker ([Note: one engine call at a time] in sequencer.py); ``poll`` calls never wait for
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
        self._scaling, self._threads = scaling, scaling.threads_per_worker or max(1, int(scaling.cpus_per_worker))
        self._actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Worker)  # once: every actor, spares too
        self.collective_timeout_s = spec.zero.collective_timeout_s
        # [Note: rendezvous timeout]: how long joining a re-formed group may take
        self.rendezvous_timeout_s = min(_REFORM_RENDEZVOUS_S, self.collective_timeout_s)
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

    def _reserve(self, count: int) -> List[Slot]:
        """Place ``count`` bundles with the scaling's strategy, waited for up to placement_timeout_s:
        one placement group of ``count`` bundles, or with spares one of a bundle each, on the nodes
        the strategy chose ([Note: spare placement]). Raises PlacementError."""
        scaling, bundle = self._scaling, self._bundle
        deadline = time.monotonic() + scaling.placement_timeout_s
        gang = placement_group([dict(bundle) for _ in range(count)], strategy=scaling.placement_strategy)
        pgs = [gang]
        try:
            _wait_placed(pgs, deadline)
            if not self._singles:
                self.pg, self._pgs = gang, [gang]
                return [(gang, i) for i in range(count)]
            nodes = ray.util.placement_group_table(gang)["bundles_to_node_id"]
            remove_placement_group(gang)
            pgs = [_single(bundle, nodes.get(i)) for i in range(count)]
            _wait_placed(pgs, deadline)
        except PlacementError:
            for pg in pgs:
                remove_placement_group(pg)
            wanted = ", ".join(f"{k} {v * count:g}" for k, v in bundle.items())
            raise PlacementError(
                f"could not place {count} worker(s) of {bundle} each ({wanted} in all, strategy "
                f"{scaling.placement_strategy}) within placement_timeout_s={scaling.placement_timeout_s:g}: "
                f"{_cluster_offer()}. Ask for fewer workers (ScalingConfig.num_workers), fewer CPUs per worker "
                "(cpus_per_worker), or add nodes.") from None
        self._pgs = list(pgs)
        return [(pg, 0) for pg in pgs]

    def _new_actor(self, rank: int, slot: Optional[Slot]) -> Any:
        """A worker actor in ``slot`` (a placement group's bundle), or outside any (None); rank -1: a spare."""
        scaling = self._scaling
        strategy = "DEFAULT" if slot is None else PlacementGroupSchedulingStrategy(
            placement_group=slot[0], placement_group_bundle_index=slot[1])
        return self._actor_cls.options(
            num_cpus=scaling.cpus_per_worker, num_gpus=1 if scaling.use_gpu else 0,
            scheduling_strategy=strategy, max_concurrency=ENGINE_THREADS, max_restarts=0,
            name=None).remote(rank, self.num_workers, self._threads, scaling.use_gpu)

    def start_spares(self) -> None:
        """Start spares up to the count kept, each in a placement group of its own ([Note: spare
        placement]); neither the placement nor the warm-up is waited for. None once shut down."""
        if not self.actors:
            return
        for _ in range(self._spare_count - len(self.spares)):
            self._add_spare(None)

    def release_spares(self) -> None:
        """Kill the spares and remove their placement groups, so that what they held is free (a
        resize places its new group next to this one); ``start_spares`` brings them back."""
        spares, self.spares = self.spares, []
        for actor, slot, _ in spares:
            _kill(actor)
            self._release(slot)

    def _add_spare(self, slot: Optional[Slot]) -> None:
        """Start a spare in ``slot`` (None: in a new placement group of its own) and have it load
        what a build imports; not waited for."""
        if slot is None:
            pg = _single(self._bundle, None)
            self._pgs.append(pg)
            slot = (pg, 0)
        actor = self._new_actor(-1, slot)
        self.spares.append((actor, slot, actor.warm.remote(self._spec)))

    def _release(self, slot: Optional[Slot]) -> None:
        """Remove ``slot``'s placement group, when it is one of a bundle of its own (a spare's)."""
        if slot is not None and slot[0] is not self.pg and slot[0] in self._pgs:
            self._pgs.remove(slot[0])
            try:
                remove_placement_group(slot[0])
            except Exception:  # noqa: BLE001 - already removed
                pass

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

    def spares_warm(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` for every spare to be started and warm; whether they are."""
        refs = [ref for _, _, ref in self.spares]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return len(ready) == len(refs)

    # --- replacing lost workers ([Note: replace, don't restart]) ------------------------------

    def replace(self, spec: WorkerSpec, timeout_s: float) -> Dict[str, float]:
        """Put a worker in every rank that is not a survivor (a spare, or a new actor in the rank's
        bundle), then re-form the collective group at the same size with every worker building
        its engine again. Returns the seconds of each phase. Raises PlacementError when a new
        worker does not start within ``timeout_s`` (the caller then restarts the whole group);
        a worker failure during it raises as ``wait_all`` does (the group is broken again)."""
        if self.failed is None or not self.survivors:
            raise RuntimeError("replace: the group has no survivors to keep (a zeroray bug)")
        t0 = time.monotonic()
        lost = [r for r in range(self.num_workers) if r not in self.survivors]
        self.spares, freed = drop_dead_spares(self.spares)
        used_spares = cold_spares = 0
        warming = {id(actor): ref for actor, _, ref in self.spares}
        imported = []  # per new worker, its warm call: it has imported what setup imports once returned
        for rank in lost:
            spare = take_spare(self.spares)
            if spare is not None:
                freed.append(self.bundles[rank])
                self.actors[rank], self.bundles[rank], warm = spare
                imported.append(warming[id(self.actors[rank])])
                used_spares += 1
                cold_spares += not warm
            else:  # the new actor takes the lost one's bundle (where Ray places it again if its node died)
                self.actors[rank] = self._new_actor(rank, self.bundles[rank])
                imported.append(self.actors[rank].warm.remote(spec))
            self._next_seq[rank] = 0
        try:
            return self._re_form(spec, timeout_s, lost, t0, used_spares, cold_spares, imported)
        finally:  # spares again, where the lost workers were; not before the re-form, which they would slow
            keep = max(0, self._spare_count - len(self.spares)) if self._pgs else 0
            for slot in freed[:keep]:
                self._add_spare(slot)
            for slot in freed[keep:]:
                self._release(slot)

    def shrink(self, spec: WorkerSpec, timeout_s: float) -> Dict[str, float]:
        """Re-form the group of the survivors alone, renumbered in rank order, every one building
        its engine again for the smaller world ([Note: shrink in memory]). The lost ranks' workers
        (a replacement that could not start included) are killed and their slots released.
        Returns the seconds of each phase; a worker failure during it raises as ``wait_all`` does."""
        if self.failed is None or not self.survivors:
            raise RuntimeError("shrink: the group has no survivors to keep (a zeroray bug)")
        t0 = time.monotonic()
        keep = sorted(self.survivors)
        lost = [r for r in range(self.num_workers) if r not in keep]
        for rank in lost:
            _kill(self.actors[rank])
            self._release(self.bundles[rank])
        self.actors = [self.actors[r] for r in keep]
        self.bundles = [self.bundles[r] for r in keep]
        self._next_seq = [self._next_seq[r] for r in keep]
        self.num_workers = len(keep)
        return {**self._re_form(spec, timeout_s, lost, t0, 0, 0), "replaced": 0, "shrunk_from": len(keep) + len(lost)}

    def _re_form(self, spec: WorkerSpec, timeout_s: float, lost: List[int], t0: float, used_spares: int,
                 cold_spares: int, imported: Sequence[Any] = ()) -> Dict[str, float]:
        """``replace``'s second half: wait for the new workers to start and to have imported what
        setup imports (``imported``: their warm calls), so that the rendezvous, which has a short
        timeout of its own ([Note: rendezvous timeout]), waits for no import; then the rendezvous
        and the builds."""
        refs = self.poll("node_info")
        ready, _ = ray.wait(refs + list(imported), num_returns=len(refs) + len(imported), timeout=timeout_s)
        if len(ready) < len(refs) + len(imported):
            raise PlacementError(f"replace: the new worker(s) for rank(s) {lost} did not start within "
                                 f"{timeout_s:g} s: {_cluster_offer()}")
        self._answers(list(imported), "start")
        self.nodes = node_list(self._answers(refs, "start"))
        t1 = time.monotonic()
        master_port = self._answers(self.poll("free_port", ranks=[0]), "re-form the group")[0]
        spec = spec.in_group(f"zr-{uuid.uuid4().hex[:8]}")
        self.failed, self.survivors = None, []
        joining = self.rendezvous_timeout_s
        self.setup_info = self.wait_all(self.call_each("setup", [(spec, self.nodes[0].ip, master_port, r,
                                                                  self.num_workers, joining)
                                                                 for r in range(self.num_workers)]),
                                        None, "re-form the group", grace_s=2 * joining + _FAILURE_GRACE_S)
        return {"replaced": len(lost), "spares_used": used_spares, "cold_spares": cold_spares,
                "replace_start_s": t1 - t0,
                "setup_s": time.monotonic() - t1, "rendezvous_s": max(i.rendezvous_s for i in self.setup_info),
                "build_s": max(i.build_s for i in self.setup_info)}

    def _answers(self, refs: List[Any], what: str) -> List[Any]:
        """ray.get of polls during ``replace``; when a worker died meanwhile, the group fails as
        ``wait_all`` makes it fail (the ones still alive kept), so the caller can replace again."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as error:
            probes = [a.node_info.remote() for a in self.actors]
            ready, _ = ray.wait(probes, num_returns=len(probes), timeout=5.0)
            alive = []
            for rank, ref in enumerate(probes):
                try:
                    if ref in ready:
                        ray.get(ref)
                        alive.append(rank)
                except ray.exceptions.RayActorError:
                    pass
            dead = [r for r in range(self.num_workers) if r not in alive]
            message = f"replace ({what}): worker(s) {dead} died: {first_line(error)}"
            self._tear_down(message, alive)
            raise WorkerDiedError(message, dead, error) from error

    # --- calls -----------------------------------------------------------------------------

    def call(self, method: str, *args: Any, ranks: Optional[Sequence[int]] = None, after_ok: bool = False,
             num_returns: int = 1) -> List[Any]:
        """Start engine call ``method`` on every actor (or ``ranks``), each in its turn; object refs
        in rank order. ``after_ok``: skip it (it returns Cancelled) where the call before it failed."""
        ranks = range(self.num_workers) if ranks is None else ranks
        return self.call_each(method, [args] * len(ranks), ranks=ranks, after_ok=after_ok, num_returns=num_returns)

    def call_each(self, method: str, per_rank_args: Sequence[Sequence[Any]], *,
                  ranks: Optional[Sequence[int]] = None, after_ok: bool = False, num_returns: int = 1) -> List[Any]:
        """``call`` with other arguments per worker: ``per_rank_args[i]`` for ``ranks[i]``."""
        self._check_usable()
        ranks = range(self.num_workers) if ranks is None else ranks
        refs = []
        with self._numbering:  # one call's tickets at a time, so every worker runs calls in one order
            for rank, args in zip(ranks, per_rank_args):
                ticket = Ticket(self._next_seq[rank], after_ok)
                self._next_seq[rank] += 1
                remote = getattr(self.actors[rank], method)
                if num_returns != 1:
                    remote = remote.options(num_returns=num_returns)
                refs.append(remote.remote(ticket, *args))
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
            _kill(actor)
        self.actors, self.spares = [], []
        pgs, self._pgs, self.pg = self._pgs, [], None
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass

    # --- results and failures ----------------------------------------------------------------

    def wait_all(self, refs: List[Any], timeout_s: Optional[float], what: str,
                 ranks: Optional[Sequence[int]] = None, lockstep: bool = False,
                 independent: bool = False, grace_s: float = _FAILURE_GRACE_S) -> List[Any]:
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
                except Exception as error:  # noqa: BLE001 - analysed below
                    errors[rank_of[ref]] = error
                    if first_error_at is None:
                        first_error_at = time.monotonic()
        if not errors and not pending:
            return [results[r] for r in ranks]
        self._fail(errors, [rank_of[r] for r in pending], what, sorted(results) if lockstep else [],
                   answered=sorted(results))
        raise AssertionError("unreachable")

    def _fail(self, errors: Dict[int, BaseException], pending: List[int], what: str,
              succeeded: Sequence[int] = (), answered: Sequence[int] = ()) -> None:
        """Raise the error that explains a failed wait_all; see [Note: failure detection].
        ``answered``: the ranks whose call returned a result (kept as survivors with the ranks
        that raised, when the group keeps survivors: [Note: replace, don't restart])."""
        kinds = {rank: classify_error(e) for rank, e in errors.items()}
        dead = sorted(r for r, k in kinds.items() if k is ErrorKind.DIED)
        alive = sorted((set(errors) | set(answered)) - set(dead))
        if dead:
            cause = errors[dead[0]]
            message = (f"{what}: worker(s) {self._describe(dead)} died: {first_line(cause)}. " + (
                "The other workers were kept: fit replaces the lost one(s) and resumes from the in-memory snapshot"
                if self.keep_survivors and alive else
                "The worker group was shut down; fit restarts from the last checkpoint when "
                "FailureConfig(max_failures) allows it"))
            self._tear_down(message, alive)
            raise WorkerDiedError(message, dead, cause) from cause
        users = sorted(r for r, k in kinds.items() if k in (ErrorKind.USER, ErrorKind.PEER_STEP))
        if users:
            # The failing worker's own error; the others' PeerStepErrors only say that it failed.
            own = [r for r in users if kinds[r] is ErrorKind.USER] or users
            error = worker_error(errors[own[0]], f"worker {self._describe(own[:1])[1:-1]} during {what}")
            stuck = sorted(set(pending) | (set(errors) - set(users)))
            if stuck or succeeded:  # they wait (or timed out waiting) in a collective, or went on without them
                message = (f"worker(s) {own} raised during {what} while worker(s) {stuck} waited in a collective"
                           if stuck else f"worker(s) {own} raised during {what} while worker(s) {list(succeeded)} "
                           "completed it")
                self._tear_down(message)
                error.add_note(f"zeroray: {message}, so the worker group was shut down: build a new Trainer "
                               "or zr.Trainer.restore(...) from a checkpoint")
            raise error
        broken = sorted(errors)  # every error is a broken connection or a timed-out collective
        late = self._late_ranks(pending)
        timed_out = [r for r in broken if kinds[r] is ErrorKind.TIMEOUT]
        cause = errors[broken[0]] if broken else None
        if timed_out and all(isinstance(getattr(errors[r], "cause", errors[r]), RendezvousError) for r in timed_out):
            message = (f"{what}: the rendezvous did not complete within rendezvous_timeout_s="
                       f"{self.rendezvous_timeout_s:g} s on worker(s) {self._describe(timed_out)}, and no worker died "
                       "([Note: rendezvous timeout]): a loaded machine; "
                       + (f"worker(s) {self._describe(late)} did not answer and are replaced; " if late else "")
                       + ("the others were kept, the re-form is tried again" if self.keep_survivors else
                          "the worker group was shut down"))
            self._tear_down(message, sorted(set(alive) - set(late)))
            raise CollectiveTimeoutError(message, late, cause) from cause
        if timed_out or not errors:  # not errors: nothing came back before the driver's deadline
            waited = f"; worker(s) {self._describe(timed_out)} waited for them and timed out" if timed_out else ""
            message = (f"{what}: a collective did not complete within collective_timeout_s="
                       f"{self.collective_timeout_s:g} s: worker(s) {self._describe(late) if late else '(unknown)'} "
                       f"did not arrive{waited}. Every worker must run the same forward/backward (same modules, "
                       "same number of micro-batches); if one is just slow (data loading, a long first step), "
                       "raise ZeroConfig(collective_timeout_s=...). The worker group was shut down")
            self._tear_down(message, sorted(set(alive) - set(late)))
            raise CollectiveTimeoutError(message, late, cause) from cause
        message = (f"{what}: worker(s) {self._describe(broken)} lost the connection to a peer "
                   f"({first_line(cause)}); worker(s) {self._describe(late) if late else '(unknown)'} "
                   "probably died or became unreachable. The worker group was shut down")
        self._tear_down(message, sorted(set(alive) - set(late)))
        raise WorkerGroupError(message, late, cause) from cause

    def _late_ranks(self, pending: List[int]) -> List[int]:
        """Ranks that did not reach the collective the others are in: fewest collectives issued this step."""
        refs = {}
        for rank, actor in enumerate(self.actors):
            try:
                refs[rank] = actor.progress.remote()
            except Exception:  # noqa: BLE001 - a dead actor has no progress
                pass
        progress = {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        for rank, ref in refs.items():
            if ref in ready:
                try:
                    p = ray.get(ref)
                    progress[rank] = (p.step or 0, p.collectives)
                except Exception:  # noqa: BLE001
                    pass
        if len(set(progress.values())) > 1:
            ahead = max(progress.values())
            return sorted(r for r, p in progress.items() if p < ahead)
        return sorted(pending)

    def _describe(self, ranks: Sequence[int]) -> str:
        where = []
        for r in ranks:
            node = self.nodes[r] if r < len(self.nodes) else None
            where.append(f"{r} (pid {node.pid} on {node.ip})" if node else str(r))
        return "[" + ", ".join(where) + "]"

    def _tear_down(self, reason: str, alive: Sequence[int] = ()) -> None:
        """Mark the group failed and kill its workers; with ``keep_survivors``, the ``alive`` ones
        (their call came back) stay for ``replace`` ([Note: replace, don't restart])."""
        self.failed = reason
        if self.keep_survivors and alive:
            log.warning("zeroray: %s; keeping worker(s) %s, replacing the others", reason, list(alive))
            self.survivors = list(alive)
            for rank, actor in enumerate(self.actors):
                if rank not in self.survivors:
                    _kill(actor)
            return
        log.warning("zeroray: %s; shutting the worker group down", reason)
        self.shutdown()
