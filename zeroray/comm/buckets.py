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
is allocated once and reused every step; a bucket waits for a free buffer rather than
allocating one, unless every buffer is still being filled (arrival order far from the plan).

In a negotiated stage-3 step (negotiate.py) over a backend without independent channels
(NCCL), ``hold=True`` keeps every launch for ``finish``, after the agreement rounds, so the
reductions never interleave with the rounds' gathers in one stream of collectives.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from zeroray.arena import FlatLayout
from zeroray.comm.group import Channel, Group


@dataclass
class Piece:
    unit: int
    a: int    # first column of the unit's (rows, row_numel) view
    b: int    # end column
    off: int  # first column inside the bucket's rows


@dataclass
class Bucket:
    index: int
    pieces: List[Piece] = field(default_factory=list)
    row_numel: int = 0
    num_params: int = 0


@dataclass
class _Copy:
    bucket: int
    src: int     # offset into the parameter's flat gradient
    length: int
    dst: int     # offset into the bucket's flat input buffer


class GradBuckets:
    """Reduce gradients into ``target`` (an fp32 1D tensor: grad shard, or full grads)."""

    def __init__(self, layout: FlatLayout, group: Group, target: torch.Tensor, *,
                 mode: str, bucket_bytes: int, dtype: torch.dtype, unit_order: Sequence[int]) -> None:
        assert mode in ("reduce_scatter", "all_reduce")
        self.layout, self.group, self.target, self.mode, self.dtype = layout, group, target, mode, dtype
        self.rows = group.world_size if mode == "reduce_scatter" else 1
        elem = torch.tensor([], dtype=dtype).element_size()
        self.capacity = max(bucket_bytes // (self.rows * elem), 1)  # columns per bucket
        self.buckets: List[Bucket] = []
        self.copies: Dict[str, List[_Copy]] = {}
        self._plan(list(unit_order))
        self._free: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.pool_size = 0
        self.hold = False       # see the module docstring
        self.accepting = True   # this backward's gradients go through the buckets (else autograd keeps them)
        self.wait = _plain_wait  # the engine's polling waiter (comm/waiter.py)
        self._reset()

    # --- plan ------------------------------------------------------------------------------

    def _row(self, unit) -> Tuple[int, int]:
        """(row_numel, target offset) of a unit in this mode."""
        if self.mode == "reduce_scatter":
            return unit.shard_numel, unit.shard_offset
        return unit.padded, unit.full_offset

    def _plan(self, unit_order: List[int]) -> None:
        bucket = Bucket(0)
        for ui in unit_order:
            unit = self.layout.units[ui]
            row_numel, _ = self._row(unit)
            a = 0
            while a < row_numel:
                if bucket.row_numel == self.capacity:
                    self.buckets.append(bucket)
                    bucket = Bucket(len(self.buckets))
                b = min(row_numel, a + self.capacity - bucket.row_numel)
                bucket.pieces.append(Piece(ui, a, b, bucket.row_numel))
                bucket.row_numel += b - a
                a = b
        if bucket.pieces:
            self.buckets.append(bucket)
        for bucket in self.buckets:
            names = set()
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
                            names.add(name)
            bucket.num_params = len(names)
        self.max_row_numel = max((b.row_numel for b in self.buckets), default=0)

    # --- per step --------------------------------------------------------------------------

    def begin_backward(self, accepting: bool) -> None:
        """Before a micro-batch: reduce its gradients (``accepting``) or leave them to autograd;
        launch as buckets fill until a negotiated fetch says to hold them."""
        self.accepting, self.hold = accepting, False

    def _reset(self) -> None:
        self._pending = [b.num_params for b in self.buckets]
        self._seen: Dict[Tuple[int, str], bool] = {}
        self._bufs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._next_launch = 0
        self._inflight: deque = deque()  # (bucket index, handle)

    def _acquire(self, bucket: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if bucket in self._bufs:
            return self._bufs[bucket]
        if not self._free and self._inflight:
            self._complete_oldest()
        if self._free:
            inp, out = self._free.pop()
        else:
            inp = torch.empty(self.rows * self.max_row_numel, dtype=self.dtype, device=self.target.device)
            # reduce-scatter: the output, then the group's scratch (received rows on gloo)
            out = inp[:self.max_row_numel] if self.mode == "all_reduce" else torch.empty(
                self._out_numel(), dtype=self.dtype, device=self.target.device)
            self.pool_size += 1
        rows = self.buckets[bucket].row_numel
        inp[:self.rows * rows].zero_()  # padding columns carry no gradient
        self._bufs[bucket] = (inp, out)
        return inp, out

    def add_grad(self, name: str, grad: torch.Tensor) -> None:
        """Copy one parameter's (full, local) gradient into its buckets; launch what is ready.

        Copies come in bucket order; each bucket is counted and launched as soon as its part is
        copied, so a parameter spanning many buckets recycles a few buffers instead of holding one
        per bucket."""
        flat = grad.reshape(-1)
        current = None
        for c in self.copies.get(name, ()):
            if c.bucket != current:
                if current is not None:
                    self._arrived(current, name)
                current = c.bucket
            inp, _ = self._acquire(c.bucket)
            inp[c.dst:c.dst + c.length].copy_(flat[c.src:c.src + c.length])
        if current is not None:
            self._arrived(current, name)

    def _arrived(self, bucket: int, name: str) -> None:
        if (bucket, name) not in self._seen:
            self._seen[(bucket, name)] = True
            self._pending[bucket] -= 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        if self.hold and not force:
            return
        while self._next_launch < len(self.buckets) and (force or self._pending[self._next_launch] == 0):
            b = self._next_launch
            inp, out = self._acquire(b)
            rows = self.buckets[b].row_numel
            if self.mode == "reduce_scatter":
                handle = self.group.reduce_scatter(out[:rows], inp[:self.rows * rows], async_op=True,
                                                   scratch=out[self.max_row_numel:], channel=Channel.REDUCE)
            else:
                handle = self.group.all_reduce(inp[:rows], async_op=True)
            self._inflight.append((b, handle))
            self._next_launch += 1

    def _complete_oldest(self) -> None:
        b, handle = self._inflight.popleft()
        self.wait(handle)
        inp, out = self._bufs.pop(b)
        with torch.no_grad():
            for piece in self.buckets[b].pieces:
                _, t_off = self._row(self.layout.units[piece.unit])
                self.target[t_off + piece.a:t_off + piece.b].add_(
                    out[piece.off:piece.off + piece.b - piece.a].to(self.target.dtype))
        self._free.append((inp, out))

    def launch_all(self) -> None:
        """End of one backward: launch what is left (missing gradients count as zero)."""
        self._launch_ready(force=True)

    def finish(self) -> None:
        """End of one backward: launch what is left, wait for every reduction, start over."""
        self._launch_ready(force=True)
        while self._inflight:
            self._complete_oldest()
        self._reset()

    def buffer_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per = self.rows * self.max_row_numel + (0 if self.mode == "all_reduce" else self._out_numel())
        return self.pool_size * per * elem

    def _out_numel(self) -> int:
        return self.max_row_numel + self.group.scratch_numel(self.max_row_numel)


def _plain_wait(handle) -> None:
    handle.wait()


def default_unit_order(layout: FlatLayout) -> List[int]:
    """Order in which gradients are expected: reverse layout order (backward runs forward's reverse)."""
    return [u.index for u in reversed(layout.units)]
