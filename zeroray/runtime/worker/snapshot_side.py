"""The worker's half of an in-memory snapshot: capture it between two steps, copy it out beside
the next one, hold a buddy's copy, and assemble a new worker's state from the old shards on
recovery (``SnapshotSide``, which the actor's snapshot calls delegate to). See [Note: in-memory
snapshots] and [Note: overlapped snapshot copy] in runtime/snapshot.py, the driver's half."""
from __future__ import annotations

import base64
import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.runtime.records import SnapshotRecord
from zeroray.runtime.worker.state_transfer import PieceAssembler, cut_pieces, from_wire, to_wire

# How long an engine call waits for a snapshot's arrays to be let go of before it runs the
# cycle collector (see SnapshotSide.wait_copy).
RELEASE_POLL_S = 10.0


@dataclass
class Capture:
    """What a snapshot takes in its turn between two steps ([Note: overlapped snapshot copy]):
    what the next step's forward may change (the random generator, rank 0's buffers), the
    step, and the engine whose state ``copy_shard`` then copies beside that forward. ``stored``:
    set once Ray has stored that copy (the next update waits for it)."""

    engine: Any
    rng: torch.Tensor
    untrained: Any
    step: int
    stored: Optional[threading.Event] = None


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


def snapshot_bytes(engine: Any) -> int:
    """What one in-memory snapshot of this rank takes in the object store, outside this process
    (FailureConfig(snapshot_every), [Note: in-memory snapshots]): 1/N of the model states."""
    tensors, _ = engine.export_state(live=True)  # only the sizes are read
    return sum(t.numel() * t.element_size() for t in tensors.values())


class SnapshotSide:
    """One worker's half of the in-memory snapshots, and the only writer of its state: the buddy's
    shard held here, the copy of this rank's last snapshot until Ray has stored it, the state
    staged on recovery. The actor's snapshot calls (worker/actor.py) are thin: their turns and
    concurrency groups are the actor's, the work is here."""

    def __init__(self) -> None:
        self._held: Any = None  # another rank's snapshot shard held here ([Note: buddy copies] in runtime/snapshot.py)
        self._copying: Optional[threading.Event] = None  # set once the last snapshot's copy is stored
        self._staged: Any = None  # recovery: the state ``stage`` assembled, until ``apply``

    def hold(self, shard_refs: List[Any]) -> None:
        """``Worker.hold_copy``: fetch another rank's snapshot shard into this node's object store and
        hold it there until the next one ([Note: buddy copies] in runtime/snapshot.py). The ref
        arrives in a list so that Ray does not fetch it before the call; a shard lost already is
        skipped."""
        self._held = None  # the previous copy goes first: one held at a time
        try:
            self._held = ray.get(shard_refs[0])
        except Exception:  # noqa: BLE001 - nothing to copy; the snapshot's own copy decides
            self._held = None

    def capture(self, engine: Any, rank: int) -> Any:
        """``Worker.snapshot_shard``'s turn: what the next step's forward may change (a ``Capture``),
        once the snapshot before it is stored; with offload="disk" the whole shard, since the disk
        tier reads and writes beside the next step ([Note: overlapped snapshot copy])."""
        self.wait_copy()  # the snapshot before (none is taken twice without a step between)
        taken = capture(engine, rank)
        if engine.zero.offload is not None:
            return copy_shard(taken, released=lambda: None)
        taken.stored = self._copying = threading.Event()
        return taken

    def copy_out(self, taken: Any) -> Tuple[Any, Any, Any]:
        """After the turn, beside the next step's forward: the shard of ``capture``'s answer (as it
        is when the turn exported it already). Its arrays may be views of the live state: the
        update waits until Ray has stored them ([Note: overlapped snapshot copy])."""
        if not isinstance(taken, Capture):
            return taken
        try:
            return copy_shard(taken, released=taken.stored.set)
        except BaseException:
            taken.stored.set()  # nothing of the live state was returned
            raise

    def wait_copy(self) -> None:
        """Wait for the snapshot copy in progress, if any, to be stored ([Note: overlapped snapshot
        copy] in runtime/snapshot.py)."""
        done = self._copying
        if done is None:
            return
        # Ray lets go of the returned arrays right after storing them. Were they caught in a
        # reference cycle instead (a failed store's traceback), only the cycle collector frees them.
        while not done.wait(RELEASE_POLL_S):
            gc.collect()

    def stage(self, engine: Any, old_layout: FlatLayout, shard_refs: List[Any],
              untrained_refs: List[Any]) -> Optional[str]:
        """``Worker.stage_snapshot``, recovery's first half: fetch and assemble this rank's state from
        a snapshot (no collective). None when done; what went wrong when a shard is lost (the driver
        then falls back to the disk checkpoint, with no worker left waiting in a collective)."""
        layout, rank = engine.state_layout()
        try:
            self._staged = assemble(old_layout, (layout, rank), shard_refs, untrained_refs)
        except Exception as error:  # noqa: BLE001 - reported to the driver, which falls back
            self._staged = None
            return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return None

    def apply(self, engine: Any) -> int:
        """``Worker.apply_snapshot``: import the staged state into ``engine``; its step count."""
        (tensors, scalars), untrained = self._staged
        self._staged = None
        engine.import_state(tensors, scalars)
        engine.import_untrained(untrained)
        return engine.step_count

    def drop_staged(self) -> None:
        """The engine the staged state was for is gone (a new setup)."""
        self._staged = None
