"""In-memory snapshots of the training state during fit, outside the workers' processes.

[Note: in-memory snapshots]
With ``FailureConfig(snapshot_every=K)``, every K-th step of a fit is followed, on every
worker, by ``Worker.snapshot_shard``: the worker exports its state (``Engine.export_state``, what
a checkpoint holds for its rank; rank 0 also its buffers and frozen parameters) and *returns*
it (views of the live state where it can: [Note: overlapped snapshot copy]). A value an
actor task returns is a Ray object owned by the caller, the driver: a large one lives in the
object store (plasma, the shared memory of the worker's node, served by that node's
raylet), a small one inline in the driver's memory; in neither case in the worker's
heap, so it survives the worker's death. The driver keeps the refs; nothing is written to disk.

Order without a barrier: the snapshot call is numbered right after the step it captures
([Note: one engine call at a time] in worker/sequencer.py), with ``after_ok``, so it runs after that
step and before the next one, which fit has already queued, and only if the step succeeded;
the next step is ``after_ok`` behind the snapshot. fit's pipeline is not broken: the copy
runs on the workers beside the next step ([Note: overlapped snapshot copy]).

[Note: overlapped snapshot copy]
The snapshot call's turn between two steps is short: it captures only what the next step's
forward and backward may change (the random generator, rank 0's buffers) and the step count,
then ends, and the next step starts. The call goes on, outside the turn, exporting the state
(``export_state(live=True)``) beside that forward and backward, which read the master and
optimizer state but do not write them. The export copies nothing it need not: the master (one
tensor at stage 3 and in mixed precision) and the optimizer's per-element state (one flat
tensor per key, [Note: flat optimizer state] in engine/flat_state.py) are returned as numpy
views of the live tensors; only stage 0 (its shard cut out of the full tensors) and stages
1-2 in fp32 (the master is the arena's rows) copy the master first. The one copy is Ray's:
it writes a returned value into the object store after the method returned, on the thread
that ran it (Ray 2.60's ``execute_task`` in _raylet.pyx calls ``store_task_outputs`` there,
then drops the outputs). The next update must not start before that copy ends, or the
snapshot could hold a half-updated state. So ``on_release`` hangs a finalizer on every
returned array (the serializer holds each array until it has written it), and the last one
to go sets the event that the next update waits for (``Engine.train_step``'s
``before_update``); so does every other engine call (a save, a rebuild, a restore). Were
the arrays caught in a reference cycle (a failed store's traceback), the waiting call runs
the cycle collector now and then. (A tiny call to the actor itself in a one-thread group of
the snapshot's, which Ray could start only after the store, would deadlock: the next
snapshot, queued in that group before it, waits for its turn behind the next step, whose
update waits for that call.) So the snapshot costs the step what forward and backward
cannot hide of one copy into the store, most of it the page faults of the store's pages
the worker writes for the first time (benchmarks/snapshot_copy_cpu.py). A snapshot becomes
the complete one only when the driver has its records, which Ray hands out only once the
call returned and its three values are stored: a worker that dies during the export or the
store leaves the snapshot before it the complete one, never a half copy. With
``ZeroConfig(offload="disk")`` the export copies and stays inside the turn: the disk tier
reads and writes the optimizer state beside the next step's forward.

[Note: buddy copies]
Where a shard physically lives: the worker that returns it writes it into the object store of
its own node (a return value is stored where the task ran), and the driver owns it. So a
node's death takes a worker and its shard together. Each time a snapshot becomes the complete
one, the driver asks every rank's *buddy*, the next rank on another node, to fetch that rank's
shard (``Worker.hold_copy``, on a thread of its own beside the next step): the fetch pulls the
object into the buddy's node store, and the buddy holds it (its arrays are views of that
copy, which pins it) until the next snapshot's. The owner knows both locations, so when the
first node dies Ray serves the shard from the copy. Cost: on a cluster, one more shard per
worker in its buddy's node store, and the network copy, overlapped with the next step; on one
node there is no buddy and no cost. A worker and its buddy lost together (two nodes, or one
node before the copy arrived) lose the shard: the fallback is the disk checkpoint, as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

from zeroray.checkpoint import plan
from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import owned_by, param_owners


@dataclass
class Snapshot:
    """One fit step's state, held in Ray objects the driver owns; see [Note: in-memory snapshots].

    ``shards[r]``: old rank r's ``{"tensors": {key: wire array}, "scalars": {...}}`` in the
    coordinates of ``layout`` (the group's layout when it was taken); ``untrained``: rank 0's
    buffers and frozen parameters; ``records``: one small ``SnapshotRecord`` per rank, what the
    driver waits on. ``step``/``data_position``: set when the driver collected the step."""

    layout: FlatLayout
    shards: List[Any]
    untrained: Any
    records: List[Any]
    step: int = -1
    data_position: int = -1


def needed_ranks(old_layout: FlatLayout, target: Tuple[FlatLayout, int], whole_params: bool = False) -> List[int]:
    """The old ranks whose shards hold a new worker's slices, or its per-rank values, and with
    ``whole_params`` (an optimizer stepping whole parameters) the state of the parameters it owns."""
    new_layout, rank = target
    ranks = {c.src_rank for c in plan(old_layout, new_layout, rank)}
    ranks.add(min(rank, old_layout.world_size - 1))  # where a new rank takes its scalars (as a resize does)
    if whole_params:
        old_owner = param_owners(old_layout)
        ranks.update(old_owner[name] for name in owned_by(new_layout, rank))
    return sorted(ranks)
