"""The worker's half of an in-memory snapshot: capture it between two steps, copy it out beside
the next one, and assemble a new worker's state from the old shards on recovery. See [Note:
in-memory snapshots] and [Note: overlapped snapshot copy] in runtime/snapshot.py, the driver's half."""
from __future__ import annotations

import base64
import gc
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.runtime.records import SnapshotRecord
from zeroray.runtime.worker.state_transfer import PieceAssembler, cut_pieces, from_wire, to_wire
from zeroray.runtime.worker.sequencer import Cancelled, Ticket, engine_call

# How long an engine call waits for a snapshot's arrays to be let go of before it runs the
# cycle collector (see SnapshotCalls._wait_copy).
RELEASE_POLL_S = 10.0


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


def copy_shard(taken: Capture, released: Callable[[], None]) -> Tuple[Dict[str, Any], Any, SnapshotRecord]:
    """``Worker.snapshot_shard``'s three return values: (this rank's shard, rank 0's untrained
    state or None, a small record), from the state as it was at ``taken``. The shard's arrays
    may be views of the live state ([Note: overlapped snapshot copy]): ``released`` is called
    once Ray has let go of every one of them, that is, once it has stored them; at once if the
    export copied everything (offload="disk")."""
    engine = taken.engine
    live = engine.zero.offload is None  # the disk tier's loaded state goes back to its files
    tensors, scalars = engine.export_state(live=live)
    if scalars.get("step") != taken.step:
        raise RuntimeError(f"the snapshot of step {taken.step} saw step {scalars.get('step')}: the update ran "
                           "during its copy (a zeroray bug)")
    # The generator as it was between the steps, in export_state's encoding (engine/state.py):
    # the next step's forward may have drawn from it since.
    scalars["rng"] = base64.b64encode(taken.rng.numpy().tobytes()).decode()
    wire = {k: to_wire(v) for k, v in tensors.items()}
    del tensors
    if live:
        on_release(list(wire.values()), released)
    else:
        released()
    return {"tensors": wire, "scalars": scalars}, taken.untrained, SnapshotRecord(taken.step)


def on_release(values: List[Any], callback: Callable[[], None]) -> None:
    """Call ``callback`` once every one of ``values`` is gone (on the thread that drops the last
    reference); see [Note: overlapped snapshot copy]. The caller keeps no reference to them."""
    left = [len(values)]
    lock = threading.Lock()

    def gone() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()
    if not values:
        callback()
    for value in values:
        weakref.finalize(value, gone)


def assemble(old_layout: FlatLayout, target: Tuple[FlatLayout, int], shard_refs: List[Any],
             untrained_refs: List[Any]) -> Tuple[Tuple[Dict[str, torch.Tensor], Dict[str, Any]], Dict[str, Any]]:
    """A new worker's (tensors, scalars) and untrained state from a snapshot, fetching the old
    shards it needs one at a time (``shard_refs[r]`` is None for the ones it does not need).
    Raises what ``ray.get`` raises when a shard is lost."""
    assembler = PieceAssembler(target[0])
    for old_rank, ref in enumerate(shard_refs):
        if ref is None:
            continue
        shard = ray.get(ref)
        tensors = {k: from_wire(v) for k, v in shard["tensors"].items()}
        assembler.add(cut_pieces(old_layout, old_rank, tensors, shard["scalars"], [target])[0])
        del shard, tensors  # before fetching the next: one old shard at a time
    return assembler.state(), ray.get(untrained_refs[0])


class SnapshotCalls:
    """The actor's snapshot calls: take one behind a step, hold a buddy's copy, stage and apply one
    on recovery. Mixed into ``Worker`` (actor.py), whose state it is (``engine``, ``rank``, the
    sequencer, ``_copy``, ``_copy_done``, ``_staged``)."""

    @ray.method(concurrency_group="copy")
    def hold_copy(self, shard_refs: List[Any]) -> None:
        """Fetch another rank's snapshot shard into this node's object store and hold it there
        until the next one ([Note: buddy copies] in runtime/snapshot.py). The ref arrives in a
        list so that Ray does not fetch it before the call; a shard lost already is skipped."""
        self._copy = None  # the previous copy goes first: one held at a time
        try:
            self._copy = ray.get(shard_refs[0])
        except Exception:  # noqa: BLE001 - nothing to copy; the snapshot's own copy decides
            self._copy = None

    def snapshot_shard(self, ticket: Ticket) -> Tuple[Any, Any, Any]:
        """fit's in-memory snapshot of this rank's state ([Note: in-memory snapshots] in
        runtime/snapshot.py): (shard, rank 0's untrained state or None, a small record), three
        Ray objects the driver owns. Called with num_returns=3 and ``after_ok`` behind the step
        it captures; not ``engine_call`` only so that a cancelled call still returns three
        values. Its turn only captures what the next step's forward may change; the state is
        exported after the turn, beside that forward, and Ray's store of it is the copy
        ([Note: overlapped snapshot copy])."""
        self._arrived.at = time.time()
        done = threading.Event()

        def take() -> Any:
            self._wait_copy()  # the snapshot before (none is taken twice without a step between)
            taken = capture(self.engine, self.rank)
            if self.engine.zero.offload is not None:  # the disk tier reads and writes beside the next step
                return copy_shard(taken, released=lambda: None)
            self._copy_done = done
            return taken
        out = self._sequencer.run(ticket, take)
        if isinstance(out, Cancelled):
            return out, None, out
        if not isinstance(out, Capture):
            return out
        try:
            # The shard may hold views of the live state: ``done`` is set once Ray has stored
            # them, after this method returned ([Note: overlapped snapshot copy]).
            return copy_shard(out, released=done.set)
        except BaseException:
            done.set()  # nothing of the live state was returned
            raise

    def _wait_copy(self) -> None:
        """Wait for the snapshot copy in progress, if any, to be stored ([Note: overlapped snapshot
        copy] in runtime/snapshot.py)."""
        done = self._copy_done
        if done is None:
            return
        # Ray lets go of the returned arrays right after storing them. Were they caught in a
        # reference cycle instead (a failed store's traceback), only the cycle collector frees them.
        while not done.wait(RELEASE_POLL_S):
            gc.collect()

    @engine_call
    def stage_snapshot(self, old_layout: FlatLayout, shard_refs: List[Any], untrained_refs: List[Any]
                       ) -> Optional[str]:
        """Recovery, first half: fetch and assemble this rank's state from a snapshot (no
        collective). None when done; what went wrong when a shard is lost (the driver then falls
        back to the disk checkpoint, with no worker left waiting in a collective)."""
        layout, rank = self.engine.state_layout()
        try:
            self._staged = assemble(old_layout, (layout, rank), shard_refs, untrained_refs)
        except Exception as error:  # noqa: BLE001 - reported to the driver, which falls back
            self._staged = None
            return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return None

    @engine_call
    def apply_snapshot(self) -> int:
        """Recovery, second half: import the staged state (collective at stages 1-2)."""
        (tensors, scalars), untrained = self._staged
        self._staged = None
        self.engine.import_state(tensors, scalars)
        self.engine.import_untrained(untrained)
        return self.engine.step_count
