"""Gradient reduction through constant-size coalescing buckets (the paper's C_B).

[Note: gradient buckets]
A static plan cuts the units, in the order their gradients are expected (reverse of the
forward order), into *pieces* and packs the pieces into buckets of at most ``bucket_bytes``.
For reduce-scatter a unit is seen as an (W, shard_numel) matrix, row r being what rank r
owns; a piece is a column range [a, b) of that matrix, and a bucket's input is an
(W, row_numel) matrix whose column blocks are its pieces. Reduce-scatter leaves row
``rank`` summed over ranks, i.e. exactly the slices this rank owns, which are added into
the rank's fp32 gradient shard. For all-reduce (stage 0) the matrix has one row.

Gradients arrive one parameter at a time (a post-accumulate-grad hook), are copied into
their bucket's buffer and dropped. A bucket whose parameters have all arrived is launched
asynchronously, but only in plan order (see [Note: collective order] in group.py), so the
reduction of one bucket overlaps the rest of backward. Buffers come from a small pool that
is allocated once and reused every step; with ``max_inflight`` reductions in flight, a bucket
waits for the oldest to finish rather than allocating a buffer (unless every buffer is still
being filled: arrival order far from the plan; nor in backward where the model's backward has
collectives of its own: [Note: no wait in backward]). One in flight for full-size buckets, which
keeps the pool at the paper's few C_B; two where buckets are cut small by the flush timeout
(``timed=True``): a bucket's first gradient would otherwise wait for the reduction of the
bucket just launched, in the middle of backward. Where buckets are sized from a model smaller
than ``bucket_bytes`` ([Note: first bucket] in bucket_plan.py), as many as fit in
``bucket_bytes`` (all of a small model's): the pool holds what one full-size bucket would,
and backward never waits for a peer's progress through an earlier bucket. A fixed plan's first bucket is small (1 MiB,
as DDP's), so that a reduction starts early in backward.

[Note: no wait in backward]
A wait for the oldest reduction inside backward (a hook taking a buffer from a full pool) is safe
only while every peer launches that bucket without needing this rank first. Launches follow
the plan order on every rank, so two ranks' bucket waits never wait on each other; but a
peer launches a bucket one of whose parameters brought it no gradient only at the end of its
backward (``finish``: a rank whose rows leave a layer unused), and a model whose backward
issues collectives of its own (a synchronising SyncBatchNorm's all_reduce on the user's group,
[Note: SyncBatchNorm on CPU] in engine/sync_batchnorm.py) stops a peer's backward until this
rank issues the same collective. This rank, blocked on the bucket, never does: each waits for
the other until the collective timeout (on NCCL, whose wait orders streams instead, the same
cycle can form on the GPU streams). torch DDP's reducer never waits in backward (its buckets are the whole gradient), so it
finishes. So with ``backward_collectives`` the pool never waits in backward: a bucket that
finds no free buffer while the oldest reduction is still in flight gets a new buffer, past
the bound; the pool keeps it for the next steps (``pool_size`` and ``buffer_bytes`` count it).
The waits move to ``finish``, after this rank's own backward collectives are issued. A
reduction already complete is still recycled first, so the pool grows only while reductions
lag behind backward, at most to one buffer per bucket (the whole gradient, as DDP's buckets).
Without collectives in backward (the common case) the pool waits, and keeps its bound. The
engine knows the collectives of SyncBatchNorm modules; a user's own collective inside an
autograd function's backward (``torch.distributed.nn.functional``) is not seen, and such a
model with buckets smaller than the model and layers some ranks leave unused can still hang.

In a negotiated stage-3 step (fetch/negotiate.py) over a backend without independent channels
(NCCL), ``hold_until_finish`` keeps every launch for ``finish``, after the agreement rounds, so the
reductions never interleave with the rounds' gathers in one stream of collectives.

[Note: scaled write]
A bucket's buffer is not cleared as a whole when it is taken: only its holes (padding columns,
which no gradient is copied into) are zeroed then, and, when it is launched at the end of
backward, the ranges of the parameters that brought no gradient. Where the step reduces once
(one micro-batch, or stages 0-1, which reduce on the last) and the pieces cover the target,
the engine passes the step's scale (1 / (ranks x micro-batches x loss scale)) to
``begin_backward`` and each reduced piece is written into the target as ``scale x sum``: no
clearing of the target before the step, no add, no pass to scale it after. The bits are those
of the add into a cleared target followed by the scaling (0 + x = x), but for the sign of a zero
gradient. Steps that reduce several times (stages 2-3 accumulating) add as before.

The plan itself (comm/bucket_plan.py) may end a bucket early, after a unit whose successor's
gradients come too late: the flush timeout, planned from measured steps so that every rank
cuts the same buckets ([Note: bucket timeout]); ``replan`` installs a new plan between steps.
Each backward records when every unit's gradients arrived (``last_timeline``), what the
tuner learns from, and each step counts why its buckets were launched and how long their
first tensor waited (``take_stats``).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.comm.bucket_plan import FIRST_BUCKET_BYTES, Cut, Piece, Timeline, fixed_capacity, pack
from zeroray.comm.group import Channel, Group
from zeroray.layout.stage import ReduceMode


@dataclass
class Bucket:
    index: int
    pieces: List[Piece] = field(default_factory=list)
    row_numel: int = 0
    num_params: int = 0
    cut: Cut = Cut.END  # why the plan ends it here


@dataclass
class _Copy:
    bucket: int
    src: int     # offset into the parameter's flat gradient
    length: int
    dst: int     # offset into the bucket's flat input buffer


class GradBuckets:
    """Reduce gradients into ``target`` (an fp32 1D tensor: grad shard, or full grads)."""

    def __init__(self, layout: FlatLayout, group: Group, target: torch.Tensor, *,
                 mode: ReduceMode, bucket_bytes: int, dtype: torch.dtype, unit_order: Sequence[int],
                 timed: bool = False, wait: Optional[Callable] = None, backward_collectives: bool = False) -> None:
        """``wait``: how a reduction is waited for (the engine's polling waiter, comm/waiter.py;
        by default the handle's own wait). ``backward_collectives``: the model's backward issues
        collectives of its own, so the pool never waits in backward ([Note: no wait in backward])."""
        assert isinstance(mode, ReduceMode), mode
        self.layout, self.group, self.target, self.mode, self.dtype = layout, group, target, mode, dtype
        self.rows = group.world_size if mode is ReduceMode.REDUCE_SCATTER else 1
        self.unit_order = list(unit_order)
        self.timed = timed
        self.backward_collectives = backward_collectives
        self.unit_columns = {u.index: self._row(u)[0] for u in layout.units}
        self.column_bytes = self.rows * torch.tensor([], dtype=dtype).element_size()
        self.model_bytes = sum(self.unit_columns.values()) * self.column_bytes
        self._free: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.pool_size = 0
        self._buf_numel = 0     # columns the pooled buffers were allocated for
        self._hold = False      # launches wait for finish: hold_until_finish
        self._write_scaled: Optional[float] = None  # [Note: scaled write]
        self.accepting = True   # this backward's gradients go through the buckets (else autograd keeps them)
        self.wait = wait if wait is not None else _plain_wait
        self.last_timeline: Optional[Timeline] = None  # of the last finished backward
        self._stats = _new_stats()
        self._bufs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._inflight: deque = deque()
        self.replan(bucket_bytes, frozenset())

    # --- plan ------------------------------------------------------------------------------

    def _row(self, unit) -> Tuple[int, int]:
        """(row_numel, target offset) of a unit in this mode."""
        if self.mode is ReduceMode.REDUCE_SCATTER:
            return unit.shard_numel, unit.shard_offset
        return unit.padded, unit.full_offset

    def replan(self, bucket_bytes: int, cuts: AbstractSet[int]) -> None:
        """Install the plan of ``bucket_bytes`` buckets ending after ``cuts`` (between steps only)."""
        assert not self._inflight and not self._bufs, "a new plan is installed between steps only"
        self.bucket_bytes = bucket_bytes
        first = None
        if self.timed:  # the tuner's plan: its size and timeout cuts
            self.capacity = max(bucket_bytes // self.column_bytes, 1)  # columns per bucket
        else:  # [Note: first bucket] in bucket_plan.py
            self.capacity = max(fixed_capacity(bucket_bytes, self.model_bytes) // self.column_bytes, 1)
            first = max(FIRST_BUCKET_BYTES // self.column_bytes, 1)
        # Reductions in flight before a bucket waits (module docstring): two where buckets are cut
        # small by the timeout; as many as bucket_bytes holds where they are sized from the model.
        sized = self.capacity * self.column_bytes
        self.max_inflight = 2 if self.timed else max(bucket_bytes // sized, 2) if sized < bucket_bytes else 1
        self.buckets = []
        self.copies: Dict[str, List[_Copy]] = {}
        for index, spec in enumerate(pack(self.unit_order, self.unit_columns, self.capacity, cuts, first)):
            self.buckets.append(Bucket(index, spec.pieces, spec.row_numel, cut=spec.cut))
        self._copies()
        self.max_row_numel = max((b.row_numel for b in self.buckets), default=0)
        # Pooled buffers stay while they fit and are not mostly idle space.
        if self.max_row_numel > self._buf_numel or self._buf_numel > 2 * self.max_row_numel:
            self._free.clear()
            self.pool_size = 0
            self._buf_numel = self.max_row_numel
        self._reset()

    def _copies(self) -> None:
        self._dsts: List[Dict[str, List[Tuple[int, int]]]] = []  # per bucket: name -> its (dst, length)
        self._holes: List[List[Tuple[int, int]]] = []  # per bucket: the input ranges no gradient is copied into
        for bucket in self.buckets:
            dsts: Dict[str, List[Tuple[int, int]]] = {}
            for piece in bucket.pieces:
                unit = self.layout.units[piece.unit]
                row_numel, _ = self._row(unit)
                for name in unit.params:
                    slot = self.layout.slots[name]
                    for r in range(self.rows):
                        lo = max(slot.offset, r * row_numel + piece.a)
                        hi = min(slot.offset + slot.numel, r * row_numel + piece.b)
                        if hi > lo:
                            dst = r * bucket.row_numel + piece.off + lo - r * row_numel - piece.a
                            self.copies.setdefault(name, []).append(
                                _Copy(bucket.index, lo - slot.offset, hi - lo, dst))
                            dsts.setdefault(name, []).append((dst, hi - lo))
            bucket.num_params = len(dsts)
            self._dsts.append(dsts)
            self._holes.append(_gaps(sorted(r for ranges in dsts.values() for r in ranges),
                                     self.rows * bucket.row_numel))
        # Whether the pieces cover every element of the target once: then a step's one reduction
        # may write the target instead of adding into it ([Note: scaled write]).
        covered = sum(p.b - p.a for b in self.buckets for p in b.pieces)
        self.covers_target = covered == self.target.numel()

    # --- per step --------------------------------------------------------------------------

    def begin_backward(self, accepting: bool, write_scaled: Optional[float] = None) -> None:
        """Before a micro-batch: reduce its gradients (``accepting``) or leave them to autograd;
        launch as buckets fill until a negotiated fetch says to hold them. ``write_scaled``: this
        backward's reduction is the step's only one, and writes ``write_scaled`` times the sum
        into the target instead of adding the sum to it ([Note: scaled write]; only where
        ``covers_target``)."""
        assert write_scaled is None or self.covers_target, "a scaled write needs pieces that cover the target"
        self.accepting, self._hold, self._write_scaled = accepting, False, write_scaled

    def hold_until_finish(self) -> None:
        """Keep this backward's launches for ``finish`` (a negotiated stage-3 micro-batch without
        independent channels: see the module docstring)."""
        self._hold = True

    def _reset(self) -> None:
        self._pending = [b.num_params for b in self.buckets]
        self._seen: Dict[Tuple[int, str], bool] = {}
        self._bufs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._next_launch = 0
        self._inflight: deque = deque()  # (bucket index, handle)
        # This backward's arrivals (perf_counter seconds): see last_timeline.
        self._t0: Optional[float] = None
        self._unit_first: Dict[int, float] = {}
        self._unit_done: Dict[int, float] = {}
        self._unit_count: Dict[int, int] = {}
        self._opened: Dict[int, float] = {}  # bucket -> its first tensor's arrival

    def _acquire(self, bucket: int, in_backward: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        if bucket in self._bufs:
            return self._bufs[bucket]
        if not self._free and len(self._inflight) >= self.max_inflight and not (
                in_backward and self.backward_collectives and not self._inflight[0][1].is_completed()):
            self._complete_oldest()  # else a new buffer: [Note: no wait in backward]
        if self._free:
            inp, out = self._free.pop()
        else:
            # all-reduce: the bucket, then the group's scratch (the peer's bucket, gloo with two ranks)
            inp = torch.empty(self.rows * self._buf_numel + self._all_reduce_scratch(), dtype=self.dtype,
                              device=self.target.device)
            # reduce-scatter: the output, then the group's scratch (received rows on gloo)
            out = inp[:self._buf_numel] if self.mode is ReduceMode.ALL_REDUCE else torch.empty(
                self._out_numel(), dtype=self.dtype, device=self.target.device)
            self.pool_size += 1
        for lo, hi in self._holes[bucket]:  # padding columns carry no gradient; the rest is copied over
            inp[lo:hi].zero_()
        self._bufs[bucket] = (inp, out)
        return inp, out

    def add_grad(self, name: str, grad: torch.Tensor) -> None:
        """Copy one parameter's (full, local) gradient into its buckets; launch what is ready.

        Copies come in bucket order; each bucket is counted and launched as soon as its part is
        copied, so a parameter spanning many buckets recycles a few buffers instead of holding one
        per bucket."""
        self._record_arrival(name)
        flat = grad.reshape(-1)
        current = None
        for c in self.copies.get(name, ()):
            if c.bucket != current:
                if current is not None:
                    self._arrived(current, name)
                current = c.bucket
                if c.bucket not in self._opened:
                    self._opened[c.bucket] = time.perf_counter()
            inp, _ = self._acquire(c.bucket, in_backward=True)
            inp[c.dst:c.dst + c.length].copy_(flat[c.src:c.src + c.length])
        if current is not None:
            self._arrived(current, name)

    def _record_arrival(self, name: str) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        unit = self.layout.slots[name].unit
        self._unit_first.setdefault(unit, now)
        count = self._unit_count.get(unit, 0) + 1
        self._unit_count[unit] = count
        if count == len(self.layout.units[unit].params):
            self._unit_done[unit] = now

    def _arrived(self, bucket: int, name: str) -> None:
        if (bucket, name) not in self._seen:
            self._seen[(bucket, name)] = True
            self._pending[bucket] -= 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        if self._hold and not force:
            return
        while self._next_launch < len(self.buckets) and (force or self._pending[self._next_launch] == 0):
            b = self._next_launch
            inp, out = self._acquire(b, in_backward=not force)  # forced: after backward (finish, launch_all)
            if self._pending[b]:  # launched at the end: a parameter with no gradient here counts as zero
                for name, ranges in self._dsts[b].items():
                    if (b, name) not in self._seen:
                        for dst, length in ranges:
                            inp[dst:dst + length].zero_()
            rows = self.buckets[b].row_numel
            if self.mode is ReduceMode.REDUCE_SCATTER:
                handle = self.group.reduce_scatter(out[:rows], inp[:self.rows * rows], async_op=True,
                                                   scratch=out[self._buf_numel:], channel=Channel.REDUCE)
            elif self._all_reduce_scratch():
                handle = self.group.all_reduce(inp[:rows], async_op=True, channel=Channel.REDUCE,
                                               scratch=inp[self._buf_numel:self._buf_numel + rows])
            else:
                handle = self.group.all_reduce(inp[:rows], async_op=True)
            self._count_launch(b, Cut.END if force else self.buckets[b].cut)
            self._inflight.append((b, handle))
            self._next_launch += 1

    def _count_launch(self, bucket: int, cut: Cut) -> None:
        stats = self._stats
        stats[cut.value] += 1
        opened = self._opened.get(bucket)
        if opened is not None:  # a bucket no gradient reached on this rank has no first tensor
            stats["wait_s"] += time.perf_counter() - opened
            stats["waited"] += 1

    def _complete_oldest(self) -> None:
        b, handle = self._inflight.popleft()
        t0 = time.perf_counter()
        self.wait(handle)
        self._stats["blocked_s"] += time.perf_counter() - t0
        inp, out = self._bufs.pop(b)
        scale = self._write_scaled
        with torch.no_grad():
            for piece in self.buckets[b].pieces:
                _, t_off = self._row(self.layout.units[piece.unit])
                into, got = self.target[t_off + piece.a:t_off + piece.b], out[piece.off:piece.off + piece.b - piece.a]
                if scale is None:
                    into.add_(got.to(self.target.dtype))
                elif got.dtype == into.dtype:
                    torch.mul(got, scale, out=into)
                else:  # in the target's dtype first, as the add would: the same bits
                    into.copy_(got).mul_(scale)
        self._free.append((inp, out))

    def launch_all(self) -> None:
        """End of one backward: launch what is left (missing gradients count as zero)."""
        self._launch_ready(force=True)

    def finish(self) -> None:
        """End of one backward: launch what is left, wait for every reduction, start over."""
        end = time.perf_counter()
        self._launch_ready(force=True)
        self.last_timeline = self._timeline(end)
        while self._inflight:
            self._complete_oldest()
        self._reset()

    def _timeline(self, end: float) -> Timeline:
        """This backward's arrivals in whole microseconds since the first ([Note: bucket timeout])."""
        t0 = self._t0 if self._t0 is not None else end

        def us(t: Optional[float]) -> int:
            return int(round(((t if t is not None else end) - t0) * 1e6))
        return Timeline({u: us(self._unit_first.get(u)) for u in self.unit_order},
                        {u: us(self._unit_done.get(u)) for u in self.unit_order}, us(end))

    def take_stats(self) -> dict:
        """Launches since the last call, by why (``Cut``); the mean wait of a bucket's first tensor
        (arrival to launch); the time spent blocked on reductions (the buckets' share of the
        exposed communication). Starts counting anew."""
        stats, self._stats = self._stats, _new_stats()
        wait_ms = 1e3 * stats["wait_s"] / stats["waited"] if stats["waited"] else 0.0
        return {"full": stats["full"], "timeout": stats["timeout"], "end": stats["end"], "first_wait_ms": wait_ms,
                "blocked_ms": 1e3 * stats["blocked_s"]}

    def buffer_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per = self.rows * self._buf_numel + (self._all_reduce_scratch() if self.mode is ReduceMode.ALL_REDUCE
                                             else self._out_numel())
        return self.pool_size * per * elem

    def _all_reduce_scratch(self) -> int:
        return self.group.all_reduce_scratch_numel(self._buf_numel) if self.mode is ReduceMode.ALL_REDUCE else 0

    def _out_numel(self) -> int:
        return self._buf_numel + self.group.scratch_numel(self._buf_numel)


def _gaps(ranges: List[Tuple[int, int]], end: int) -> List[Tuple[int, int]]:
    """The parts of [0, end) that the sorted (start, length) ``ranges`` leave out."""
    gaps, at = [], 0
    for start, length in ranges:
        if start > at:
            gaps.append((at, start))
        at = max(at, start + length)
    if end > at:
        gaps.append((at, end))
    return gaps


def _new_stats() -> dict:
    return {"full": 0, "timeout": 0, "end": 0, "wait_s": 0.0, "waited": 0, "blocked_s": 0.0}


def _plain_wait(handle) -> None:
    handle.wait()


def default_unit_order(layout: FlatLayout) -> List[int]:
    """Order in which gradients are expected: reverse layout order (backward runs forward's reverse)."""
    return [u.index for u in reversed(layout.units)]
