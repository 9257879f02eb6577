"""One rank's local shard of one dtype, in shard coordinates, wherever its elements live.

[Note: local shard]
A rank's local shard ([Note: flat layout] in layout/arena.py) is the concatenation of its slice of
every unit. Usually it is one contiguous tensor: the stage-3 parameter shard, the fp32 master
in mixed precision, the fp32 gradient shard. At stages 1-2 the full parameters stay in the
persistent arena, where unit ``u``'s buffer, seen as a (W, shard_numel) matrix, holds this
rank's slice as row ``rank``: the values the rank owns are already there. A separate shard
as the all-gather source (and, in fp32, as the master) would hold P·Φ/W bytes a second time,
so at those stages the local shard *is* those rows: one piece per unit, not contiguous. The
optimizer updates the rows in place, and publishing the update gathers each unit with an
all-gather whose input is a view of its own output row, which moves nothing locally.

Code that works on a range of the shard asks for a view (``shard[a:b]``), which must lie in
one piece (a unit's slice, or any range of a contiguous shard); the flat optimizer's segments
are cut at the piece boundaries for that ([Note: flat optimizer] in engine/optim.py). ``read``
copies a range that spans pieces, ``write`` copies one in; ``copy_`` and ``clone`` move whole shards.
"""
from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple, Union

import torch

from zeroray.layout.arena import FlatLayout


class LocalShard:
    """This rank's shard as pieces ``(start, 1D view)`` laid end to end; see [Note: local shard]."""

    def __init__(self, pieces: Sequence[Tuple[int, torch.Tensor]]) -> None:
        self.pieces = list(pieces)
        self.starts = [start for start, _ in self.pieces]
        self._numel = 0
        for start, t in self.pieces:  # laid end to end, one dtype and device, each a 1D view
            assert start == self._numel and t.dim() == 1, (start, self._numel, t.shape)
            self._numel += t.numel()
        first = self.pieces[0][1]
        self.dtype, self.device = first.dtype, first.device

    @classmethod
    def contiguous(cls, tensor: torch.Tensor) -> "LocalShard":
        return cls([(0, tensor)])

    @classmethod
    def arena_rows(cls, layout: FlatLayout, arena: torch.Tensor, rank: int) -> "LocalShard":
        """Row ``rank`` of every unit's buffer in the persistent ``arena`` (stages 1-2)."""
        return cls([(u.shard_offset, arena[u.full_offset + rank * u.shard_numel:
                                           u.full_offset + (rank + 1) * u.shard_numel])
                    for u in layout.units])

    # --- tensor-like queries ----------------------------------------------------------------

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.pieces[0][1].element_size()

    @property
    def is_contiguous_tensor(self) -> bool:
        return len(self.pieces) == 1

    def as_tensor(self) -> torch.Tensor:
        """The one tensor of a contiguous shard (the master of stage 0 is the whole arena)."""
        if not self.is_contiguous_tensor:
            raise ValueError("this local shard is not one tensor (stages 1-2 keep it in the arena's rows)")
        return self.pieces[0][1]

    reads_ahead = False  # in memory: nothing to read ahead (on disk there is: offload/shard.py)

    def prefetch(self, a: int, b: int) -> None:
        """Nothing to read ahead: the shard is in memory (on disk it is not: offload/shard.py)."""

    def breaks(self) -> List[int]:
        """Where each piece after the first starts: a view never crosses one."""
        return self.starts[1:]

    def tensors(self) -> List[torch.Tensor]:
        """The pieces (views of the storages that hold the shard), for memory accounting."""
        return [t for _, t in self.pieces]

    # --- views and copies -------------------------------------------------------------------

    def _piece_of(self, a: int, b: int) -> Tuple[int, torch.Tensor]:
        i = bisect.bisect_right(self.starts, a) - 1
        start, t = self.pieces[i]
        if b - start > t.numel():
            raise IndexError(f"elements [{a}, {b}) of the local shard span two pieces (a piece ends at "
                             f"{start + t.numel()}); ask for one piece at a time")
        return start, t

    def __getitem__(self, index: slice) -> torch.Tensor:
        """A view of elements ``[a, b)``; they must lie in one piece (empty ranges are always fine)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a LocalShard is indexed by a slice [a:b] only")
        a, b, _ = index.indices(self._numel)
        if b <= a:
            return self.pieces[0][1][:0]
        start, t = self._piece_of(a, b)
        return t[a - start:b - start]

    def read(self, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)``: a view when they lie in one piece, else a new tensor (a copy)."""
        i = bisect.bisect_right(self.starts, a) - 1
        start, t = self.pieces[i]
        if b - start <= t.numel():
            return t[a - start:b - start]
        parts = []
        for s, piece in self.pieces[i:]:
            if s >= b:
                break
            parts.append(piece[max(a - s, 0):min(b - s, piece.numel())])
        return torch.cat(parts)

    def write(self, a: int, src: torch.Tensor) -> None:
        """Copy the 1D ``src`` over elements ``[a, a + src.numel())``, across pieces if it spans
        them (cast to the shard's dtype element by element, as ``copy_`` casts)."""
        b = a + src.numel()
        with torch.no_grad():
            for start, t in self.pieces[max(bisect.bisect_right(self.starts, a) - 1, 0):]:
                if start >= b:
                    break
                lo, hi = max(a, start), min(b, start + t.numel())
                if hi > lo:
                    t[lo - start:hi - start].copy_(src[lo - a:hi - a])

    def copy_(self, src: Union["LocalShard", torch.Tensor]) -> "LocalShard":
        """Copy a whole shard in (a 1D tensor in shard coordinates, or another LocalShard)."""
        assert src.numel() == self._numel, (src.numel(), self._numel)
        with torch.no_grad():
            for start, t in self.pieces:
                t.copy_(src.read(start, start + t.numel()) if isinstance(src, LocalShard)
                        else src[start:start + t.numel()])
        return self

    def clone(self) -> torch.Tensor:
        """The whole shard as a new contiguous 1D tensor on its device (detached)."""
        with torch.no_grad():
            if self.is_contiguous_tensor:
                return self.pieces[0][1].detach().clone()
            return torch.cat([t.detach() for _, t in self.pieces])

    def cpu(self) -> torch.Tensor:
        """The whole shard as a new contiguous 1D tensor in host memory (detached)."""
        return self.clone() if self.device.type == "cpu" else self.clone().cpu()
