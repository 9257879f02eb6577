"""In-memory snapshots of the training state during fit, outside the workers' processes.

[Note: in-memory snapshots]
With ``FailureConfig(snapshot_every=K)``, every K-th step of a fit is followed, on every
worker, by ``Worker.snapshot_shard``: the worker exports its state (``Engine.export_state``, what
a checkpoint holds for its rank; rank 0 also its buffers and frozen parameters) and *returns*
it. A value an actor task returns is a Ray object owned by the caller, the driver: a large one
lives in the object store (plasma, the shared memory of the worker's node, served by that
node's raylet), a small one inline in the driver's memory; in neither case in the worker's
heap, so it survives the worker's death. The driver keeps the refs; nothing is written to disk.

Order without a barrier: the snapshot call is numbered right after the step it captures
([Note: one engine call at a time] in sequencer.py), with ``after_ok``, so it runs after that
step and before the next one, which fit has already queued, and only if the step succeeded;
the next step is ``after_ok`` behind the snapshot. fit's pipeline is not broken: the copy
runs on the workers beside the next step ([Note: overlapped snapshot copy]) and the driver
never fetches the shards. When the
driver collects the step, it waits for the snapshot's small record (the step it holds) and
only then makes the snapshot the complete one, dropping the refs of the one before, which
frees its objects (Ray counts references). So at most the complete snapshot and the ones of
the steps still in flight exist: one shard per worker more than a checkpoint-less run, plus
the one being taken (1/N of the model states each).

Recovery (Controller.recover) restores the complete snapshot when it is newer than the last
disk checkpoint: every new worker fetches, one at a time, the old shards that hold its slices
(the pure range math of ``checkpoint.reshard.plan``, as a resize does, so a restart at another
size works too; [Note: resize transfer] in state_transfer.py), and only when every worker has
fetched its share does any import it (the import is collective at stages 1-2). A snapshot is
lost when the object store that held a shard is gone: its node died (on one machine, that is
the head node, and the driver with it), or Ray evicted or could not restore a spilled object.
A worker that cannot fetch a shard says so instead of raising; the driver then drops the
snapshot and falls back to the last disk checkpoint (or the initial weights), as without
snapshots. Since [Note: replace, don't restart] (worker_group.py), the survivors stay and load
the snapshot too, so the recovery costs no process start when a warm spare takes the lost rank.

[Note: overlapped snapshot copy]
The snapshot call's turn between two steps is short: it captures only what the next step's
forward and backward may change (the random generator, rank 0's buffers) and the step count,
then ends, and the next step starts. The call goes on, outside the turn, copying the state
(``export_state``) beside that forward and backward, which read the master and optimizer
state but do not write them; the next step's update waits for the copy to end
(``Engine.train_step``'s ``before_update``), and so does every other engine call (a save, a
rebuild, a restore). So the copy costs the step what forward and backward cannot hide, not
its whole length. A snapshot becomes the complete one only when the driver has its records,
which Ray hands out only once the call returned and its three values are stored: a worker
that dies during the copy leaves the snapshot before it the complete one, never a half copy.
With ``ZeroConfig(offload="disk")`` the copy stays inside the turn: the disk tier reads and
writes the optimizer state beside the next step's forward.

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

import base64
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.checkpoint import plan
from zeroray.layout.arena import FlatLayout
from zeroray.runtime.state_transfer import PieceAssembler, cut_pieces, from_wire, to_wire


@dataclass
class Snapshot:
    """One fit step's state, held in Ray objects the driver owns; see [Note: in-memory snapshots].

    ``shards[r]``: old rank r's ``{"tensors": {key: wire array}, "scalars": {...}}`` in the
    coordinates of ``layout`` (the group's layout when it was taken); ``untrained``: rank 0's
    buffers and frozen parameters; ``records``: one small ``{"step": n}`` per rank, what the
    driver waits on. ``step``/``data_position``: set when the driver collected the step."""

    layout: Dict[str, Any]
    shards: List[Any]
    untrained: Any
    records: List[Any]
    step: int = -1
    data_position: int = -1


# --- the worker's side -------------------------------------------------------------------------


@dataclass
class Capture:
    """What a snapshot takes in its turn between two steps ([Note: overlapped snapshot copy]):
    what the next step's forward may change (the random generator, rank 0's buffers), the
    step, and the engine whose state ``copy_shard`` then copies beside that forward."""

    engine: Any
    rng: torch.Tensor
    untrained: Any
    step: int


def capture(engine: Any, rank: int) -> Capture:
    return Capture(engine, torch.get_rng_state(), engine.untrained_state() if rank == 0 else None,
                   engine.step_count)


def copy_shard(taken: Capture) -> Tuple[Dict[str, Any], Any, Dict[str, int]]:
    """``Worker.snapshot_shard``'s three return values: (this rank's shard, rank 0's untrained
    state or None, a small record), from the state as it was at ``taken``."""
    engine = taken.engine
    tensors, scalars = engine.export_state()
    if scalars.get("step") != taken.step:
        raise RuntimeError(f"the snapshot of step {taken.step} saw step {scalars.get('step')}: the update ran "
                           "during its copy (a zeroray bug)")
    # The generator as it was between the steps, in export_state's encoding (engine/state.py):
    # the next step's forward may have drawn from it since.
    scalars["rng"] = base64.b64encode(taken.rng.numpy().tobytes()).decode()
    # Ray copies a return value into the object store after the call returned, when the next
    # step's update may already run: a tensor that is the live master (stages 1-3 on the CPU)
    # is copied first, so the snapshot cannot catch that update half-way. Export's other tensors are new.
    live = engine.master_shard().data_ptr()
    shard = {"tensors": {k: to_wire(v.clone() if v.data_ptr() == live else v) for k, v in tensors.items()},
             "scalars": scalars}
    return shard, taken.untrained, {"step": taken.step}


def needed_ranks(old_layout: FlatLayout, target: Tuple[Dict[str, Any], int]) -> List[int]:
    """The old ranks whose shards hold a new worker's slices, or its per-rank values."""
    layout_dict, rank = target
    ranks = {c.src_rank for c in plan(old_layout, FlatLayout.from_dict(layout_dict), rank)}
    ranks.add(min(rank, old_layout.world_size - 1))  # where a new rank takes its scalars (as a resize does)
    return sorted(ranks)


def assemble(old_layout_dict: Dict[str, Any], target: Tuple[Dict[str, Any], int], shard_refs: List[Any],
             untrained_refs: List[Any]) -> Tuple[Tuple[Dict[str, torch.Tensor], Dict[str, Any]], Dict[str, Any]]:
    """A new worker's (tensors, scalars) and untrained state from a snapshot, fetching the old
    shards it needs one at a time (``shard_refs[r]`` is None for the ones it does not need).
    Raises what ``ray.get`` raises when a shard is lost."""
    old_layout = FlatLayout.from_dict(old_layout_dict)
    assembler = PieceAssembler(FlatLayout.from_dict(target[0]))
    for old_rank, ref in enumerate(shard_refs):
        if ref is None:
            continue
        shard = ray.get(ref)
        tensors = {k: from_wire(v) for k, v in shard["tensors"].items()}
        assembler.add(cut_pieces(old_layout, old_rank, tensors, shard["scalars"], [target])[0])
        del shard, tensors  # before fetching the next: one old shard at a time
    return assembler.state(), ray.get(untrained_refs[0])


# --- the driver's side -------------------------------------------------------------------------


def buddies(node_ids: List[str]) -> List[Optional[int]]:
    """Per rank, its buddy ([Note: buddy copies]): the first rank after it (cyclically) whose
    worker runs on another node; None where every other rank shares its node."""
    n = len(node_ids)
    return [next(((r + k) % n for k in range(1, n) if node_ids[(r + k) % n] != node_ids[r]), None)
            for r in range(n)]


class SnapshotKeeper:
    """The complete snapshot of a fit, if any; see [Note: in-memory snapshots]."""

    def __init__(self, every: Optional[int]) -> None:
        self.every = every
        self.complete: Optional[Snapshot] = None

    def due(self, step: int) -> bool:
        """Whether the step that ends at step count ``step`` is followed by a snapshot."""
        return bool(self.every) and step % self.every == 0

    def promote(self, snapshot: Snapshot, step: int, data_position: int) -> None:
        """``snapshot`` (its records were waited for) is the complete one; the one before is released."""
        snapshot.step, snapshot.data_position = step, data_position
        self.complete = snapshot  # the old one's refs go with it: Ray frees its objects

    def drop(self) -> None:
        self.complete = None
