"""Re-forming a worker group after a failure: put new workers in the lost ranks, or shrink to the survivors.

``replace`` and ``shrink`` work on a ``WorkerGroup`` (group.py) through its public methods (``seat``,
``keep_only``, ``rejoin``, ``tear_down``) and on its ``Placement`` (placement.py) for the spares and
slots; the controller's recovery (controller/recovery.py) calls them.

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
same range math as a resize ([Note: resize transfer] in worker/state_transfer.py). So the state is
resharded from N to N-1 in memory, and at most the failed step is redone. Without snapshots
no survivor is kept, and where the snapshot is lost (a worker and its buddy both died) the
disk checkpoint is loaded into the shrunk group instead, as a restart does. The lost rank's
bundle in a shared placement group stays reserved, empty, until the group ends (Ray cannot
drop one bundle); with spares it was a placement group of its own and is removed. A lower
``min_workers`` than ``num_workers`` is what allows it: by default the group waits for its
full size, as before.

[Note: rendezvous timeout]
A re-form is a new rendezvous (comm/group.py's ``make_torch_group``: a TCPStore on rank 0, then
gloo connecting every pair). Its survivors join at once; the replacement joins after its setup
starts. When the replacement dies before it joined (chaos's "replacement killed during
re-form"), the survivors wait in the rendezvous for a peer that never comes: bounded by the
collective timeout, they were still waiting when the driver's grace ended, were killed, and the
whole group restarted. So a re-form's rendezvous has a timeout of its own, the group's
``rendezvous_timeout_s`` (``REFORM_RENDEZVOUS_S`` in group.py, at most the collective timeout),
after which each survivor's setup raises ``RendezvousError`` with its process intact (its state
comes back from the snapshot, as after any replacement); the collectives afterwards keep
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

import time
from typing import Any, Dict, List, Sequence

import ray

from zeroray.runtime.failures import PlacementError, WorkerDiedError, first_line
from zeroray.runtime.records import WorkerSpec, node_list
from zeroray.runtime.worker_group.group import WorkerGroup
from zeroray.runtime.worker_group.placement import cluster_offer


def replace(group: WorkerGroup, spec: WorkerSpec, timeout_s: float) -> Dict[str, float]:
    """Put a worker in every rank of ``group`` that is not a survivor (a spare, or a new actor in
    the rank's bundle), then re-form the collective group at the same size with every worker
    building its engine again. Returns the seconds of each phase. Raises PlacementError when a new
    worker does not start within ``timeout_s`` (the caller then restarts the whole group); a
    worker failure during it raises as ``wait_all`` does (the group is broken again)."""
    if group.failed is None or not group.survivors:
        raise RuntimeError("replace: the group has no survivors to keep (a zeroray bug)")
    t0 = time.monotonic()
    lost = [r for r in range(group.num_workers) if r not in group.survivors]
    placement = group.placement
    placement.drop_dead_spares()
    new = []
    for rank in lost:
        worker = placement.replacement(rank, spec)
        group.seat(rank, worker.actor)
        new.append(worker)
    try:
        return _re_form(group, spec, timeout_s, lost, t0, sum(w.spare for w in new),
                        sum(w.spare and not w.warm for w in new), [w.imported for w in new])
    finally:  # spares again, where the lost workers were; not before the re-form, which they would slow
        placement.restock()


def shrink(group: WorkerGroup, spec: WorkerSpec, timeout_s: float) -> Dict[str, float]:
    """Re-form the group of the survivors alone, renumbered in rank order, every one building
    its engine again for the smaller world ([Note: shrink in memory]). The lost ranks' workers
    (a replacement that could not start included) are killed and their slots released.
    Returns the seconds of each phase; a worker failure during it raises as ``wait_all`` does."""
    if group.failed is None or not group.survivors:
        raise RuntimeError("shrink: the group has no survivors to keep (a zeroray bug)")
    t0 = time.monotonic()
    keep = sorted(group.survivors)
    lost = [r for r in range(group.num_workers) if r not in keep]
    group.keep_only(keep)
    return {**_re_form(group, spec, timeout_s, lost, t0, 0, 0), "replaced": 0, "shrunk_from": len(keep) + len(lost)}


def _re_form(group: WorkerGroup, spec: WorkerSpec, timeout_s: float, lost: List[int], t0: float, used_spares: int,
             cold_spares: int, imported: Sequence[Any] = ()) -> Dict[str, float]:
    """The second half of a re-form: wait for the new workers to start and to have imported what
    setup imports (``imported``: their warm calls), so that the rendezvous, which has a short
    timeout of its own ([Note: rendezvous timeout]), waits for no import; then the rendezvous
    and the builds (``WorkerGroup.rejoin``)."""
    refs = group.poll("node_info")
    ready, _ = ray.wait(refs + list(imported), num_returns=len(refs) + len(imported), timeout=timeout_s)
    if len(ready) < len(refs) + len(imported):
        raise PlacementError(f"replace: the new worker(s) for rank(s) {lost} did not start within "
                             f"{timeout_s:g} s: {cluster_offer()}")
    _answers(group, list(imported), "start")
    nodes = node_list(_answers(group, refs, "start"))
    t1 = time.monotonic()
    master_port = _answers(group, group.poll("free_port", ranks=[0]), "re-form the group")[0]
    group.rejoin(spec, nodes, master_port)
    return {"replaced": len(lost), "spares_used": used_spares, "cold_spares": cold_spares,
            "replace_start_s": t1 - t0,
            "setup_s": time.monotonic() - t1, "rendezvous_s": max(i.rendezvous_s for i in group.setup_info),
            "build_s": max(i.build_s for i in group.setup_info)}


def _answers(group: WorkerGroup, refs: List[Any], what: str) -> List[Any]:
    """ray.get of polls during a re-form; when a worker died meanwhile, the group fails as
    ``wait_all`` makes it fail (the ones still alive kept), so the caller can replace again."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        probes = [a.node_info.remote() for a in group.actors]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=5.0)
        alive = []
        for rank, ref in enumerate(probes):
            try:
                if ref in ready:
                    ray.get(ref)
                    alive.append(rank)
            except ray.exceptions.RayActorError:
                pass
        dead = [r for r in range(group.num_workers) if r not in alive]
        message = f"replace ({what}): worker(s) {dead} died: {first_line(error)}"
        group.tear_down(message, alive)
        raise WorkerDiedError(message, dead, error) from error
