"""The optimizer's per-element state kept as one flat tensor per state key over the local shard.

[Note: flat optimizer state]
The inner torch optimizer creates its state lazily, one tensor per flat piece and key
(``exp_avg``, ``exp_avg_sq``, ...), and an export ([Note: per-element state] in engine/optim.py)
wants each key as one flat tensor over the local shard. Gathering the pieces into a new flat
at every export costs a zeroing pass and a copy of the whole state, on freshly allocated pages;
the in-memory snapshot exports after every step ([Note: overlapped snapshot copy] in
runtime/snapshot.py). So after each update the state is *re-homed*: per key, one flat tensor of
the state's dtype and device, and every piece's state tensor replaced by the view
``flat[start:end]`` of it. Torch's Adam, AdamW and SGD (single-tensor, foreach and fused) update
their state in place, so the views stay views, and after the first update re-homing finds
nothing to move. An export then checks that every piece's tensor is still the view at its
offset (same storage, offset, length, stride) and returns the flat itself, or a copy of it; an
optimizer that replaced a state tensor (out of place) fails the check, the export gathers the
pieces as before, and the next update re-homes again.

The regions of pieces without state are zero, which is what an export writes there: a flat is
made of zeros, a piece's region holds only its own state, a split hands the new pieces views
of the old one's ([Note: unused parameters] in engine/flat_pieces.py), and an import, which
drops every piece's state, drops the flats too. Re-homing runs inside the update (never beside
a reader of the state: the snapshot copy ends before the update starts). The disk tier keeps
the state in its files between steps ([Note: disk offload] in offload/stepper.py): no flats.
The splits' views pin only the flat, so the memory report, which counts storages, counts each
key once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


class FlatState:
    """Per state key, one flat tensor over the local shard (``numel`` elements) that the pieces'
    per-element state tensors are views of; see [Note: flat optimizer state]."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.flats: Dict[str, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the flats (an import replaces every piece's state)."""
        self.flats = {}

    def rehome(self, inner: torch.optim.Optimizer, pieces: Sequence[Any]) -> None:
        """Make every piece's per-element state tensor a view of its key's flat, moving in the ones
        that are not (new state, or a tensor the optimizer replaced)."""
        by_key: Dict[str, List[Tuple[Any, Dict[str, Any]]]] = {}
        for pc in pieces:
            state = inner.state.get(pc.param)
            for key, value in (state or {}).items():
                if _per_element(value, pc):
                    by_key.setdefault(key, []).append((pc, state))
        for key, held in by_key.items():
            first = held[0][1][key]
            if any(s[key].dtype != first.dtype or s[key].device != first.device for _, s in held):
                self.flats.pop(key, None)  # no one home for them: exports gather the pieces
                continue
            flat = self.flats.get(key)
            if flat is None or flat.dtype != first.dtype or flat.device != first.device:
                whole = _covering(first, held, self.numel)
                flat = self.flats[key] = whole if whole is not None else \
                    _new_flat(self.numel, first, [(pc.start, pc.end) for pc, _ in held])
            del first
            for pc, state in held:
                if not _is_view_at(state[key], flat, pc.start, pc.end):
                    view = flat[pc.start:pc.end]
                    with torch.no_grad():
                        view.copy_(state[key])
                    state[key] = view  # the piece's own tensor goes now: the state is never held twice

    def flat_of(self, key: str, held: Sequence[Tuple[Any, torch.Tensor]]) -> Optional[torch.Tensor]:
        """``key``'s flat when every ``(piece, state tensor)`` in ``held`` (the pieces with that key)
        is the view of it at the piece's offset, else None (the export gathers the pieces)."""
        flat = self.flats.get(key)
        if flat is None or not all(_is_view_at(v, flat, pc.start, pc.end) for pc, v in held):
            return None
        return flat


def _covering(first: torch.Tensor, held: List[Tuple[Any, Dict[str, Any]]], numel: int) -> Optional[torch.Tensor]:
    """The one piece's tensor itself where a single piece covers the whole shard (one segment: stage 0
    and any optimizer without per-group options): it becomes the flat as it is. Copying it into a new
    flat instead held the key twice at the first update, which was then the step's peak (benchmarks/
    README.md, "The first update's re-homing")."""
    pc = held[0][0]
    if len(held) == 1 and pc.start == 0 and pc.end == numel and first.dim() == 1 and first.stride() == (1,):
        return first
    return None


def _new_flat(numel: int, like: torch.Tensor, held: List[Tuple[int, int]]) -> torch.Tensor:
    """An uninitialised flat whose regions outside ``held`` are zero (the pieces' copies fill the
    rest, one at a time, each freeing its own tensor as it goes)."""
    flat = torch.empty(numel, dtype=like.dtype, device=like.device)
    end = 0
    for a, b in sorted(held):
        flat[end:a].zero_()
        end = b
    flat[end:].zero_()
    return flat


def _per_element(value: Any, pc: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == pc.param.shape


def _is_view_at(value: Any, flat: torch.Tensor, start: int, end: int) -> bool:
    """Whether ``value`` is ``flat[start:end]``: the same storage, offset, length and stride."""
    return (isinstance(value, torch.Tensor) and value.dtype == flat.dtype and value.device == flat.device
            and value.dim() == 1 and value.numel() == end - start and (value.stride() == (1,) or end - start <= 1)
            and value.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and value.storage_offset() == flat.storage_offset() + start)
