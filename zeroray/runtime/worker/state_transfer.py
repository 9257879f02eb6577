"""Resize without disk: each old worker cuts its shard into one piece per new worker, each new
worker assembles its shard from those pieces.

[Note: resize transfer]
A resize from N to M workers builds the M new workers next to the N old ones (the controller
places them first, so a placement failure leaves the trainer as it was). Then every old rank
``r`` exports its state once and returns M objects (``Worker.export_pieces``, one Ray object
per new rank): piece ``(r, j)`` holds exactly the slices of ``r``'s shard that new rank ``j``
owns, found with the pure range math of ``zeroray.checkpoint.reshard.plan``, and, from the
old rank that new rank ``j`` takes them from (``min(j, N - 1)``, as a restore does), the
per-rank scalars and unsharded tensors, and the whole-parameter optimizer state ``r`` holds of
the parameters ``j`` owns ([Note: parameter owners] in layout/owners.py). Every piece also
carries its old rank's param-group hyperparameters (the scalars' ``groups``, by group key): an
old rank holds only the groups of its own slices, and new rank ``j`` may hold a group its source
rank held none of. New rank ``j`` then fetches its N pieces one at a
time (``Worker.load_pieces``), copies each into place and drops it before fetching the next.
So an old worker holds its own state and one copy of it in pieces, and a new worker its own
state, the shard it assembles and one piece: O(model / N + model / M), never the whole
model. The pieces' bulk tensors travel as numpy arrays (pickle protocol 5, zero-copy in
Ray's object store); the old workers stay alive until every new one has loaded.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np
import ray
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import is_owned_key, owned_by, split_owned_key
from zeroray.checkpoint import is_sharded_key, plan


def to_wire(t: torch.Tensor) -> Any:
    """A flat CPU tensor as a numpy array (zero-copy through Ray); as itself where numpy has no dtype."""
    try:
        return t.detach().cpu().contiguous().numpy()
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        return t.detach().cpu().contiguous()


def from_wire(data: Any) -> torch.Tensor:
    """A read-only view of what ``to_wire`` sent (only ever copied from)."""
    if isinstance(data, torch.Tensor):
        return data
    with warnings.catch_warnings():  # Ray's buffers are read-only; this view is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def cut_pieces(old_layout: FlatLayout, old_rank: int, tensors: Mapping[str, torch.Tensor],
               scalars: Dict[str, Any], targets: Sequence[Tuple[Union[FlatLayout, Dict[str, Any]], int]]
               ) -> List[Dict[str, Any]]:
    """Old rank ``old_rank``'s piece for every new worker; see [Note: resize transfer].

    ``tensors``/``scalars``: this rank's ``Engine.export_state()`` (shard coordinates of
    ``old_layout``). ``targets[j]``: new worker ``j``'s ``Engine.state_layout()``, ``(layout,
    rank)``, the coordinates its ``import_state`` expects; the layout as itself, or in its
    ``to_dict()`` form as a checkpoint's manifest holds it."""
    sharded = {k: v for k, v in tensors.items() if is_sharded_key(k, v, old_layout.shard_numel)}
    owned = {k: v for k, v in tensors.items() if is_owned_key(k)}
    others = {k: v for k, v in tensors.items() if k not in sharded and k not in owned}
    names = set(old_layout.param_names)
    pieces = []
    for target, rank in targets:
        new_layout = target if isinstance(target, FlatLayout) else FlatLayout.from_dict(target)
        copies = [c for c in plan(old_layout, new_layout, rank) if c.src_rank == old_rank]
        wanted = set(owned_by(new_layout, rank))  # whole parameters' state goes to their new owner
        piece: Dict[str, Any] = {
            "copies": [(c.src_start, c.src_end, c.dst_start) for c in copies],
            "tensors": {k: to_wire(torch.cat([v[c.src_start:c.src_end] for c in copies]) if copies else v[:0])
                        for k, v in sharded.items()},
            "owned": {k: to_wire(v) for k, v in owned.items() if split_owned_key(k, names)[0] in wanted},
            "groups": scalars.get("groups") or {}}
        if min(rank, old_layout.world_size - 1) == old_rank:  # where new rank `rank` takes per-rank values
            piece["scalars"] = scalars
            piece["rank_tensors"] = {k: v.detach().cpu().clone() for k, v in others.items()}
        pieces.append(piece)
    return pieces


class PieceAssembler:
    """Builds one new worker's state from the old workers' pieces, one piece at a time."""

    def __init__(self, new_layout: FlatLayout) -> None:
        self.shard_numel = new_layout.shard_numel
        self.tensors: Dict[str, torch.Tensor] = {}  # key -> this rank's flat shard (1-D)
        self.scalars: Dict[str, Any] = {}
        self.groups: Dict[str, Any] = {}  # every old rank's param groups' hyperparameters, by key
        self._has_scalars = False

    def add(self, piece: Mapping[str, Any]) -> None:
        for key, data in piece["tensors"].items():
            flat = from_wire(data)
            dst = self.tensors.get(key)
            if dst is None:
                dst = self.tensors[key] = torch.zeros(self.shard_numel, dtype=flat.dtype)
            offset = 0
            for src_start, src_end, dst_start in piece["copies"]:
                n = src_end - src_start
                dst[dst_start:dst_start + n].copy_(flat[offset:offset + n])
                offset += n
        for key, data in piece.get("owned", {}).items():
            self.tensors[key] = from_wire(data).clone()  # its own memory: the piece goes after this
        self.groups.update(piece.get("groups") or {})
        if "scalars" in piece:
            self.scalars = piece["scalars"]
            self.tensors.update(piece["rank_tensors"])
            self._has_scalars = True

    def state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """(tensors, scalars) for ``Engine.import_state``."""
        if not self._has_scalars:
            raise RuntimeError("resize: no old worker sent this rank its step count and per-rank state")
        if "groups" not in self.scalars:
            return self.tensors, self.scalars
        return self.tensors, {**self.scalars, "groups": {**self.groups, **self.scalars["groups"]}}


def fetch_pieces(new_layout: FlatLayout, piece_refs: Sequence[Any]
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Resize, new side (``Worker.load_pieces``): this rank's (tensors, scalars) from the old workers'
    pieces for it, fetched one at a time and each dropped before the next."""
    assembler = PieceAssembler(new_layout)
    for ref in piece_refs:
        assembler.add(ray.get(ref))
    return assembler.state()
