"""The optimizer step with its per-element state on disk, one bounded chunk at a time.

[Note: disk offload]
With ``ZeroConfig(offload="disk")`` the inner torch optimizer's per-element state (Adam's
``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``: every state tensor shaped like its
parameter) lives in the tier's files (offload/tier.py) between steps, addressed by the offset
in the rank's flat master. ``inner.state`` keeps only what is not per element (Adam's 0-dim
``step``), so everything that reads or changes it, the splitting of pieces for parameters no
rank used ([Note: unused parameters] in engine/flat_pieces.py) among them, runs unchanged.
In mixed precision the fp32 master is in the files too, one more file (``MASTER``), read and
written with the state, and each stepped chunk is cast into the parameter memory (``target``):
[Note: master on disk] in offload/master.py. In fp32 the master is the parameters and stays in
memory, except at stage 3, where the parameter shard is in a file and the master with it
([Note: parameter shard on disk] in offload/shard.py): the "cast" is then a write of its own,
whose future the step waits for as for its others, and in fp32 the shard's file is the
master's (``shared``: no master file here, the master's chunks read from the shard's file and
its update written once). The gradient, clipping and loss scaling stay where they were.

A step walks the pieces the optimizer would step (those with a gradient) in order, cut into
chunks of at most ``chunk_elems`` elements, through three slots of buffers, one tensor per
state key each: while chunk ``i`` steps, chunk ``i + 1``'s state is being read into the next
slot and chunk ``i - 1``'s written back from the one before (the slot chunk ``i + 2`` reuses is
free once that write ends). So memory holds three chunks of state, never all of it. Chunk
``i`` steps as the user's optimizer steps anything: a flat parameter viewing the chunk of the
master (in memory, or the slot's master buffer when the master is on disk; its gradient a view
of the gradient) takes the piece's place in its param group, with
the slot's tensors and a copy of the piece's scalar state as its state, and the other pieces
have no gradient for the moment, so ``inner.step()`` updates exactly the chunk and the
buffers, in place. Adam, AdamW and SGD are elementwise, so every chunk of a piece, starting
from the same ``step``, computes what one step of the whole piece would, element for element;
the piece's scalar state afterwards is the chunk's (all chunks agree). A piece with no state
yet (never stepped: torch makes state lazily) reads no state (only its master, when that is
on disk) and lets torch make the chunk's state, which is then written like the rest. An optimizer whose state is not per element
(shaped otherwise than its parameter) is refused: chunks would change what it computes.

Across steps the I/O runs behind the model's compute too: the engine calls ``prefetch`` when
a step starts, which reads the first two chunks into their slots while forward and backward
run (the step uses them when its chunks are the ones foreseen: no piece split, none skipped;
otherwise it reads again), and a step returns without waiting for its last writes, which
finish behind the next forward (``pending``). Every read waits, on the pool's thread, for the
writes still pending, so it never sees stale state; exports, imports and ``close`` wait for
everything first (``drain``). A write that failed fails the read after it, so the error
surfaces in the next step at the latest.

What is measured (``stats``): the bytes read and written, the time the pool's threads spent in
I/O, and the time the engine's thread waited for it; ``1 - wait / io`` is the share of the disk
time hidden behind compute.

Failures: the files are allocated in full before the first step (offload/tier.py), so a full
or unwritable ``offload_dir`` stops the engine from being built, with nothing to lose. An I/O
error during a step (a disk that fails later) raises ``OffloadError`` from the step; part of the
master is then updated and part not, so the worker's state is no longer a step's, and the other
workers' steps were applied: continue from the last checkpoint (``zr.Trainer.restore``), which
holds the truth (the files are scratch). The runtime does not yet do that by itself: it reports
the error as the worker's own, like any error in user code.
Checkpoints read the files into the flat tensors they export, and an import writes them back
(``loaded``, ``spill``; the master: ``read_master``, ``write_master``).

[Note: fresh state off the heap]
A chunk with no state yet (every chunk of the first step) gets its state from torch, made
lazily inside ``inner.step()``: for Adam two tensors of the chunk's size, which the step writes
to the files and the pool's thread frees once written. Taken from the compute thread's malloc
arena, those chunk-sized blocks, one pair per chunk, freed a chunk or two later between the
small long-lived allocations of the steps around them, left holes the next chunk's pair did
not fit, and the arena grew by most of the first step's state and kept it resident. With the
parameter shard on disk (stage 3), whose allocator serves blocks under 8 MiB from the heap
(``MappedBlocks`` in memory/process.py), that was most of what a stage-3 offload worker held
beyond its tensors (benchmarks/offload_heap.py measures the stepper alone: over 31.6M fp32
elements in 23 chunks the arena grew by 146 MB in the first step, nearly all of it free, and by
nothing with the fix; docs/planning.md has the fits.py row before and after).
So a stateless chunk steps inside the shard's ``mapped`` context: torch's fresh state are
mappings of their own, handed back to the OS when freed, as the shard's buffers are
(``fresh``; a no-op without a shard on disk, where nothing fixed the threshold this low).
"""
from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from zeroray.layout.local_shard import LocalShard
from zeroray.memory.model import OFFLOAD_SLOTS as SLOTS, offload_chunk_elements
from zeroray.offload.shard import DiskShard
from zeroray.offload.tier import ELEMENT_BYTES, StateFiles

MASTER = "master"  # the file of the fp32 master, when it is on disk too ([Note: master on disk] in offload/master.py)


def element_keys(builder: Callable[[List[dict]], torch.optim.Optimizer], overrides: Sequence[Dict[str, Any]]
                 ) -> List[str]:
    """The optimizer's per-element state keys over every param group's ``overrides``, learnt
    from one step of a two-element probe (torch makes state lazily, on the first step)."""
    keys: Dict[str, None] = {}
    for over in overrides:
        probe = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
        probe.grad = torch.ones_like(probe)
        optimizer = builder([{"params": [probe], **over}])
        optimizer.step()
        for k, v in optimizer.state.get(probe, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == probe.shape:
                if k == MASTER:
                    raise ValueError(f"the optimizer keeps a state tensor named {MASTER!r}, the name of the disk "
                                     "tier's fp32 master file: rename it, or use offload=None")
                keys[k] = None
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                raise ValueError(f"the optimizer keeps state {k!r} of shape {tuple(v.shape)} for a parameter of "
                                 f"shape {tuple(probe.shape)}: offload='disk' steps the state in chunks, which "
                                 "needs it per element; use an elementwise optimizer (Adam, AdamW, SGD, ...) "
                                 "or offload=None")
    return list(keys)


class DiskStepper:
    """Steps an inner torch optimizer over flat pieces whose per-element state lives in
    ``files``, ``chunk_elems`` elements at a time; see [Note: disk offload]. ``target``: when the
    files hold the fp32 master too (a ``MASTER`` file), the parameter memory each stepped chunk
    of it is cast into ([Note: master on disk] in offload/master.py); None: the master is the
    pieces' own memory."""

    def __init__(self, files: StateFiles, chunk_elems: int,
                 target: Optional[Union[LocalShard, DiskShard]] = None) -> None:
        self.files, self.keys = files, [k for k in files.keys if k != MASTER]
        # fp32 at stage 3: the parameter shard's file holds the master's values ([Note: parameter
        # shard on disk] in offload/shard.py), so it is the master's file too
        self.shared = isinstance(target, DiskShard) and target.dtype == torch.float32
        if (target is not None) != (MASTER in files.keys or self.shared):
            raise ValueError("a disk stepper with the master on disk needs both a master file and a target")
        self.target = target
        # where a stateless chunk's step runs: torch makes its state there ([Note: fresh state off the heap])
        self.fresh: Callable[[], ContextManager] = target.mapped if isinstance(target, DiskShard) \
            else contextlib.nullcontext
        self.chunk_elems = max(1, min(chunk_elems, files.numel or 1))
        self.slots = [{k: torch.empty(self.chunk_elems, dtype=torch.float32)
                       for k in [*files.keys, *([MASTER] if self.shared else [])]} for _ in range(SLOTS)]
        self.steps, self.wait_seconds, self.step_seconds = 0, 0.0, 0.0
        # The master ranges whose state is in the files, [start, end) merged: a piece has state
        # when its start lies in one. Kept here, not in inner.state, because an optimizer whose
        # only state is per element (SGD's momentum_buffer) leaves nothing else to tell by.
        self.held: List[Tuple[int, int]] = []
        self.pending: List[Future] = []  # the last step's writes, perhaps still running
        self.prefetched: Dict[int, Tuple[Tuple[Any, int, int], List[Future]]] = {}  # chunk -> (what, reads)

    def holds(self, pc: Any) -> bool:
        return any(a <= pc.start < b for a, b in self.held)

    def _mark(self, start: int, end: int) -> None:
        spans = sorted([*self.held, (start, end)])
        merged = [spans[0]]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.held = merged

    # --- one step ---------------------------------------------------------------------------

    def _plan(self, pieces: Sequence[Any]) -> List[Tuple[Any, int, int]]:
        """The chunks (piece, start, end) of the pieces with a gradient, in order."""
        return [(pc, a, min(a + self.chunk_elems, pc.end)) for pc in pieces if pc.param.grad is not None
                for a in range(pc.start, pc.end, self.chunk_elems)]

    def _read(self, i: int, a: int, b: int, stateful: bool) -> List[Future]:
        """Start reading chunk ``i`` = master [a, b) into its slot: its state when it has some
        (``stateful``), its master when that is on disk (after the writes still pending from the
        last step, which may cover the same range)."""
        slot = self.slots[i % SLOTS]
        keys = (self.keys if stateful else []) + ([MASTER] if self.target is not None and not self.shared else [])
        reads = [self.files.read(k, a, slot[k][:b - a], after=self.pending) for k in keys]
        if self.shared:
            reads.append(self.target.read_into(a, slot[MASTER][:b - a], after=self.pending))
        return reads

    def prefetch(self, pieces: Sequence[Any]) -> None:
        """Start reading the first chunks of the next step into their slots, so that the reads
        run during forward and backward; ``step`` uses them if its chunks turn out the same
        (no piece split, none skipped), and reads again otherwise."""
        self._drop_prefetch()
        for i, (pc, a, b) in enumerate(self._plan(pieces)[:SLOTS - 1]):
            if self.holds(pc) or self.target is not None:
                self.prefetched[i] = ((pc.param, a, b), self._read(i, a, b, self.holds(pc)))

    def _drop_prefetch(self) -> None:
        for _, futures in self.prefetched.values():
            self._wait(futures)
        self.prefetched = {}

    def drain(self) -> None:
        """Wait for every read and write in flight: the files are then current (an export, an
        import, the end)."""
        self._drop_prefetch()
        pending, self.pending = self.pending, []
        self._wait(pending)

    def step(self, inner: torch.optim.Optimizer, pieces: Sequence[Any]) -> None:
        """``inner.step()`` over ``pieces`` (each with ``start``, ``end``, ``param``), one chunk at
        a time, the state moving through the slots. A piece whose ``param.grad`` is None is
        skipped, as torch skips it. The last chunks' writes are left running (``pending``)."""
        t0 = time.perf_counter()
        chunks = self._plan(pieces)
        active = list({id(pc.param): pc for pc, _, _ in chunks}.values())
        grads = {id(pc.param): pc.param.grad for pc in active}
        stateful = {id(pc.param): self.holds(pc) for pc in active}
        group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        reads: List[List[Future]] = [[] for _ in chunks]
        writes: List[List[Future]] = [[] for _ in chunks]
        prefetched, self.prefetched = self.prefetched, {}

        def read(i: int) -> None:
            pc, a, b = chunks[i]
            ahead = prefetched.pop(i, None)
            if ahead is not None and ahead[0][0] is pc.param and ahead[0][1:] == (a, b):
                reads[i] = ahead[1]
            elif stateful[id(pc.param)] or self.target is not None:
                if ahead is not None:
                    self._wait(ahead[1])  # read for other chunks: let it end before the slot is reused
                reads[i] = self._read(i, a, b, stateful[id(pc.param)])

        for pc in active:
            pc.param.grad = None
        try:
            for i in range(min(SLOTS - 1, len(chunks))):
                read(i)
            for _, futures in prefetched.values():
                self._wait(futures)
            for i, (pc, a, b) in enumerate(chunks):
                self._wait(reads[i])
                slot = self.slots[i % SLOTS]
                state = self._step_chunk(inner, group_of[id(pc.param)], pc, a, b, grads[id(pc.param)],
                                         slot, stateful[id(pc.param)])
                writes[i] = [self.files.write(k, a, state.pop(k)) for k in self.keys if k in state]
                if self.target is not None:  # the update, into the memory compute reads (cast as a publish casts)
                    cast = self.target.write(a, slot[MASTER][:b - a])
                    if cast is not None:  # the parameter shard on disk: its write ([Note: parameter shard on disk])
                        writes[i].append(cast)
                    if not self.shared:  # (shared: that write was the master's)
                        writes[i].append(self.files.write(MASTER, a, slot[MASTER][:b - a]))
                if b == pc.end:
                    inner.state[pc.param] = state  # the scalars: every chunk of the piece agrees
                    self._mark(pc.start, pc.end)
                if i + SLOTS - 1 < len(chunks):
                    if i >= 1:
                        self._wait(writes[i - 1])  # its slot is the one chunk i + 2 reads into
                    read(i + SLOTS - 1)
            # Writes still running go on behind the next forward; whatever reads next waits for them.
            self.pending = [f for f in [*self.pending, *(f for ws in writes for f in ws)] if not f.done()]
        except BaseException:
            for fs in [*reads, *writes, self.pending]:  # nothing may still write into the slots
                for f in fs:
                    f.exception()
            self.pending = []
            raise
        finally:
            for pc in active:
                pc.param.grad = grads[id(pc.param)]
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0

    def _step_chunk(self, inner: torch.optim.Optimizer, group: dict, pc: Any, a: int, b: int,
                    grad: torch.Tensor, slot: Dict[str, torch.Tensor], stateful: bool) -> Dict[str, Any]:
        """Step master [a, b) of piece ``pc`` alone (in the slot when the master is on disk, else
        in the piece's memory), with the slot's state when it has some (``stateful``); its state
        afterwards (per-element tensors under their keys, possibly the slot's own, and the scalars)."""
        lo, hi = a - pc.start, b - pc.start
        values = slot[MASTER][:hi - lo] if self.target is not None else pc.param.detach()[lo:hi]
        chunk = torch.nn.Parameter(values)
        chunk.grad = grad[lo:hi]
        if stateful:
            held = inner.state.get(pc.param) or {}
            state = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in held.items()}
            state.update({k: slot[k][:hi - lo] for k in self.keys})
            inner.state[chunk] = state
        params = group["params"]
        group["params"] = [chunk]
        try:
            with contextlib.nullcontext() if stateful else self.fresh():
                inner.step()  # stateless: torch makes the chunk's state ([Note: fresh state off the heap])
        finally:
            group["params"] = params
            state = dict(inner.state.pop(chunk, {}))
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and (v.shape != chunk.shape or k not in self.keys):
                raise ValueError(f"the optimizer keeps state {k!r} of shape {tuple(v.shape)} for a flat parameter "
                                 f"of shape {tuple(chunk.shape)}: with offload='disk' the state must be per "
                                 f"element under the keys a probe step showed ({self.keys}); use an elementwise "
                                 "optimizer (Adam, AdamW, SGD, ...) or offload=None")
        return state

    def _wait(self, futures: List[Future]) -> None:
        t0 = time.perf_counter()
        for f in futures:
            f.result()
        self.wait_seconds += time.perf_counter() - t0

    # --- whole state: checkpoints, inspection -----------------------------------------------

    def piece_state(self, inner: torch.optim.Optimizer, pc: Any) -> Optional[Dict[str, Any]]:
        """The state of piece ``pc`` as torch would hold it (its per-element tensors read from the
        files), or None when it has none."""
        if not self.holds(pc):
            return None
        self.drain()
        return {**inner.state.get(pc.param, {}), **{k: self.files.read_now(k, pc.start, pc.end) for k in self.keys}}

    @contextlib.contextmanager
    def loaded(self, inner: torch.optim.Optimizer, pieces: Sequence[Any]) -> Iterator[None]:
        """Within: ``inner.state`` holds every piece's full state, read from the files (for an
        export, which copies it out); after: the scalars only again."""
        self.drain()
        saved = {}
        for pc in pieces:
            state = self.piece_state(inner, pc)
            if state is not None:
                saved[pc.param] = inner.state.get(pc.param, {})
                inner.state[pc.param] = state
        try:
            yield
        finally:
            for param, scalars in saved.items():
                inner.state[param] = scalars

    def spill(self, inner: torch.optim.Optimizer, pieces: Sequence[Any]) -> None:
        """Move every piece's per-element state from ``inner.state`` into the files (after a
        ``load_state_dict``), keeping the scalars in memory."""
        self.drain()
        self.held = []
        for pc in pieces:
            state = inner.state.get(pc.param)
            if not state:
                continue
            self._mark(pc.start, pc.end)
            for k in self.keys:
                if k in state:
                    self.files.write_now(k, pc.start, state.pop(k))

    # --- the master, when it is on disk ([Note: master on disk] in offload/master.py) ------------

    def read_master(self, start: int, end: int) -> torch.Tensor:
        """Master elements [start, end), read from its file once every write in flight ended."""
        self.drain()
        if self.shared:
            out = torch.empty(end - start, dtype=torch.float32)
            self.target.read_into(start, out).result()
            return out
        return self.files.read_now(MASTER, start, end)

    def write_master(self, start: int, src: torch.Tensor) -> None:
        """Write ``src`` over the master from element ``start`` (an import, the initial values)."""
        self.drain()
        if self.shared:
            self.target.write(start, src.detach().to(torch.float32).reshape(-1)).result()
        else:
            self.files.write_now(MASTER, start, src)

    def buffers(self) -> List[torch.Tensor]:
        """The slots' tensors: the memory the tier holds."""
        return [t for slot in self.slots for t in slot.values()]

    def stats(self) -> Dict[str, float]:
        """Totals since the tier was made: steps, bytes read and written by the pool, seconds its
        threads spent in I/O, seconds the steps waited for it, seconds the steps took."""
        f = self.files
        return {"steps": self.steps, "bytes_read": f.bytes_read, "bytes_written": f.bytes_written,
                "io_s": f.io_seconds, "wait_s": self.wait_seconds, "step_s": self.step_seconds,
                "chunk_elems": self.chunk_elems, "buffer_bytes": len(self.buffers()) * self.chunk_elems * ELEMENT_BYTES}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.files.close()


def make_stepper(builder: Callable[[List[dict]], torch.optim.Optimizer], overrides: Sequence[Dict[str, Any]],
                 folder: Optional[str], rank: int, numel: int, chunk_bytes: int,
                 target: Optional[Union[LocalShard, DiskShard]] = None) -> Optional[DiskStepper]:
    """The disk stepper for an optimizer ``builder`` over param groups with ``overrides``, with
    the master on disk too when ``target`` is given (the parameter memory its updates are cast
    into); None when there is nothing to move (plain SGD, the master in memory). Chunks hold
    ``chunk_bytes`` over all the files (memory/model.py's ``offload_chunk_elements``)."""
    # fp32 at stage 3: the master's values are in the parameter shard's file (DiskStepper.shared)
    shared = isinstance(target, DiskShard) and target.dtype == torch.float32
    keys = element_keys(builder, overrides) + ([MASTER] if target is not None and not shared else [])
    if not keys and not shared:
        return None
    files = StateFiles(folder, rank, numel, keys)
    return DiskStepper(files, offload_chunk_elements(chunk_bytes, len(keys) + shared, numel), target)
