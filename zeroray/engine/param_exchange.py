"""Bringing whole parameters to their owners for the optimizer step, and their update back.

[Note: whole-parameter exchange]
At stages 1-3 a rank's fp32 gradient and master hold a slice of every unit ([Note: flat layout]
in layout/arena.py), so a parameter's elements are spread over the ranks, while an optimizer
that is not element-wise needs each parameter whole on its owner ([Note: parameter owners] in
layout/owners.py). Per step, after the gradient was reduced and clipped, the parameters go in
*chunks* of whole parameters, bounded in bytes (at least one parameter each), every rank
walking the same chunks in the same order ([Note: collective order] in comm/group.py):

1. Each rank fills a send buffer of W rows of equal length ``2L``: row ``o`` holds, for every
   parameter of the chunk that rank ``o`` owns, the gradient (first half) and the fp32 master
   (second half) at the parameter's offset in that row; this rank writes its own slice of
   each parameter there, and every other element is ``-0.0``.
2. One reduce-scatter (fp32): each owner receives its row summed over the ranks. Every element
   comes from exactly one rank and ``x + (-0.0)`` is ``x`` for every float ``x`` (+0.0 and -0.0
   included), so the sum is the value, bit for bit: the owner now holds each of its parameters
   whole.
3. The owner steps them (the optimizer's parameters' ``.data`` and ``.grad`` are views of the
   received row, shaped).
4. One all-gather of the rows' second halves brings every update back, and each rank writes
   its slices into its master; the step's publish (cast, gathers) then runs as on the flat path.

A chunk's rows are filled owner by owner from each owner's parameters in layout order, up to
``row_elems`` elements a row (a parameter larger than that makes a row of its own), so a chunk
carries about the same for every owner and the rows' padding stays small when the owners are
balanced. Communication per step: a reduce-scatter of 2 and an all-gather of 1 fp32 value per
element, the rows' padding added, on top of the step's own (benchmarks/README.md, "The two
optimizer paths"). The buffers (send ``W * 2L``, received ``2L``, gathered ``W * L`` fp32
elements, and the reduce-scatter's scratch) hold at most ``chunk_bytes`` together, unless one
parameter is larger; they are made for the step and let go after it (``allocate``, ``release``),
so nothing of them stays between steps.

With one worker, or at stage 0 (every rank holds every parameter whole), nothing moves: the
optimizer steps shaped views of the master and gradient themselves (``direct``), as torch DDP
steps its replicas, or, when the master is on disk (offload/master.py), copies read from it and
written back (one row, no collective). There too the parameters go in chunks when the state is
on disk ([Note: whole-parameter state on disk] in offload/param_state.py), so that memory holds
a few chunks' state; otherwise they are one chunk, stepped by one call of the optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from zeroray.comm.group import Channel, Group
from zeroray.layout.arena import FlatLayout


@dataclass(frozen=True)
class Entry:
    """One parameter in a chunk: its owner's row and where it starts in that row."""

    name: str
    owner: int
    offset: int
    numel: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    entries: Tuple[Entry, ...]
    row: int  # L: elements of each owner's row (gradients; the master's half is as long)


def plan_chunks(layout: FlatLayout, owners: Mapping[str, int], rows: int, row_elems: int) -> List[Chunk]:
    """The chunks of every parameter in ``owners`` (``rows`` owners), filled owner by owner
    up to ``row_elems`` elements a row; see [Note: whole-parameter exchange]. Pure: every rank
    plans the same chunks."""
    queues: List[List[str]] = [[] for _ in range(rows)]
    for name in layout.param_names:
        if name in owners:
            queues[owners[name]].append(name)
    heads = [0] * rows
    chunks: List[Chunk] = []
    while any(head < len(q) for head, q in zip(heads, queues)):
        entries: List[Entry] = []
        longest = 0
        for owner, queue in enumerate(queues):
            used = 0
            while heads[owner] < len(queue):
                slot = layout.slots[queue[heads[owner]]]
                if used and used + slot.numel > row_elems:
                    break
                entries.append(Entry(slot.name, owner, used, slot.numel, slot.shape))
                used += slot.numel
                heads[owner] += 1
            longest = max(longest, used)
        chunks.append(Chunk(tuple(entries), longest))
    return chunks


class ParamExchange:
    """Moves whole parameters between this rank's master and gradient (``pieces[name]`` = (start,
    lo, hi): elements [lo, hi) of the parameter at offset ``start``) and their owners' rows; see
    [Note: whole-parameter exchange]. ``group`` None: every parameter is held whole here, and
    ``direct``: the master is in memory, so the optimizer steps views of it. ``chunk_bytes``:
    what a chunk's send buffer holds (None: one chunk)."""

    def __init__(self, layout: FlatLayout, pieces: Mapping[str, Tuple[int, int, int]], master, grad: torch.Tensor,
                 owners: Mapping[str, int], group: Optional[Group], chunk_bytes: Optional[int],
                 direct: bool = False) -> None:
        assert not (direct and group is not None), "a direct exchange moves nothing between ranks"
        self.pieces, self.master, self.grad, self.group, self.direct = pieces, master, grad, group, direct
        self.rows = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        # every buffer together holds chunk_bytes: (W * 2 + 2 + W) * L fp32 values, and the scratch
        per_row = 3 * self.rows + 2 + (group.scratch_numel(2) if group is not None else 0)
        row_elems = max(1, chunk_bytes // (per_row * 4)) if chunk_bytes is not None else layout.numel + 1
        self.chunks = plan_chunks(layout, owners, self.rows, row_elems)
        self.longest = 0 if direct else max((c.row for c in self.chunks), default=0)
        self.received = self.send = self.gathered = self.scratch = None

    @property
    def step_bytes(self) -> int:
        """Bytes of the buffers during a step (none between steps)."""
        if self.direct:
            return 0
        scratch = self.group.scratch_numel(2 * self.longest) if self.group is not None else 0
        rows = self.rows if self.group is not None else 0
        return 4 * (2 * self.longest + rows * 3 * self.longest + scratch)

    def allocate(self) -> None:
        """Make the step's buffers, sized by the largest chunk."""
        if self.direct:
            return
        longest, device = self.longest, self.grad.device
        self.received = torch.empty(2 * longest, dtype=torch.float32, device=device)  # 1D [grads | values]
        if self.group is not None:
            self.send = torch.empty(self.rows * 2 * longest, dtype=torch.float32, device=device)  # (W, 2L)
            self.gathered = torch.empty(self.rows * longest, dtype=torch.float32, device=device)  # (W, L)
            scratch = self.group.scratch_numel(2 * longest)
            self.scratch = torch.empty(scratch, dtype=torch.float32, device=device) if scratch else None

    def release(self) -> None:
        """Let the step's buffers go (the optimizer's parameters must not view them any more)."""
        self.received = self.send = self.gathered = self.scratch = None

    def buffers(self) -> List[torch.Tensor]:
        """The exchange's buffers now (for the memory report: none between steps)."""
        return [t for t in (self.received, self.send, self.gathered, self.scratch) if t is not None]

    def bring(self, chunk: Chunk) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """Fill ``chunk``'s rows and reduce-scatter them: {name: (values, gradient)} of the
        parameters this rank owns in it, shaped views of the received row."""
        if self.direct:
            return {e.name: (self.master[self.pieces[e.name][0]:self.pieces[e.name][0] + e.numel].view(e.shape),
                             self.grad[self.pieces[e.name][0]:self.pieces[e.name][0] + e.numel].view(e.shape))
                    for e in chunk.entries}
        L = chunk.row
        received = self.received[:2 * L]
        if self.group is None:
            for e in chunk.entries:
                start, lo, hi = self.pieces[e.name]
                received[e.offset:e.offset + e.numel].copy_(self.grad[start:start + e.numel])
                received[L + e.offset:L + e.offset + e.numel].copy_(self.master.read(start, start + e.numel))
        else:
            send = self.send[:self.rows * 2 * L].view(self.rows, 2 * L)
            send.fill_(-0.0)  # the identity of the sum for every float, the sign of zero included
            for e in chunk.entries:
                start, lo, hi = self.pieces[e.name]
                if hi > lo:
                    row = send[e.owner]
                    row[e.offset + lo:e.offset + hi].copy_(self.grad[start:start + hi - lo])
                    row[L + e.offset + lo:L + e.offset + hi].copy_(self.master.read(start, start + hi - lo))
            if L:
                self.group.reduce_scatter(received, send.view(-1), scratch=self.scratch, channel=Channel.REDUCE)
        return {e.name: (received[L + e.offset:L + e.offset + e.numel].view(e.shape),
                         received[e.offset:e.offset + e.numel].view(e.shape))
                for e in chunk.entries if e.owner == self.rank}

    def send_back(self, chunk: Chunk) -> None:
        """All-gather the owners' updated values and write this rank's slices into its master."""
        if self.direct:
            return  # the optimizer updated the master itself
        L = chunk.row
        values = self.received[L:2 * L]
        if self.group is None:
            for e in chunk.entries:
                start, _, _ = self.pieces[e.name]
                self.master.write(start, values[e.offset:e.offset + e.numel])
            return
        if not L:
            return
        gathered = self.gathered[:self.rows * L]
        self.group.all_gather(gathered, values, channel=Channel.GATHER)
        rows = gathered.view(self.rows, L)
        for e in chunk.entries:
            start, lo, hi = self.pieces[e.name]
            if hi > lo:
                self.master.write(start, rows[e.owner, e.offset + lo:e.offset + hi])


def owned_names(chunk: Chunk, rank: int) -> List[str]:
    """The parameters ``rank`` owns in ``chunk``, in order."""
    return [e.name for e in chunk.entries if e.owner == rank]
