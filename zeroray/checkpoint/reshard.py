"""Resharding N -> M: pure range math from one world size's local shards to another's.

[Note: resharding]
Both layouts have the same units (same modules, parameters and shapes, in the same order),
so a unit element ``x`` (unit coordinates, world-size independent; see [Note: flat layout])
is owned by old rank ``x // old.shard_numel`` at local offset
``old.shard_offset + x % old.shard_numel`` and must go to new rank ``x // new.shard_numel``
at ``new.shard_offset + x % new.shard_numel``. For one new rank, ``plan`` intersects its
range of every unit with the old ranks' ranges, giving a list of contiguous copies in
local-shard coordinates, merged where both sides continue. Padding is never copied and stays
zero. The plan serves a resize in memory (``reshard_in_memory``) and a restore from files
(``load_resharded``, which reads only the byte ranges the plan names).

Scalars and other per-rank values are not sharded: optimizer step counts and loss-scaler
state are identical on every rank, so new rank ``r`` takes those of old rank
``min(r, N - 1)``. The state of an optimizer that steps whole parameters is neither: each
parameter's is in its owner's file alone, and goes to the parameter's owner at the new world
size ([Note: parameter owners] in layout/owners.py). Per-rank RNG states are therefore reused for ranks that existed and
repeated for new ones; a runtime that needs distinct streams re-seeds the added ranks.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import is_owned_key, owned_by, split_owned_key
from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike
from zeroray.checkpoint.manifest import Manifest
from zeroray.checkpoint.reader import CheckpointReader
from zeroray.checkpoint.store import is_sharded_key
from zeroray.checkpoint.tensorfile import dtype_from_code


@dataclass(frozen=True)
class Copy:
    """``new_shard[dst_start : dst_start + (src_end - src_start)] = old_shards[src_rank][src_start:src_end]``."""

    src_rank: int
    src_start: int
    src_end: int
    dst_start: int

    @property
    def numel(self) -> int:
        return self.src_end - self.src_start


def _names(names: List[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... and {len(names) - limit} more' if len(names) > limit else ''}]"


def check_same_params(old: FlatLayout, new: FlatLayout, old_name: str = "checkpoint",
                      new_name: str = "model") -> None:
    """Raise ValueError listing what differs when ``old`` and ``new`` do not hold the same units."""
    if old.same_params_as(new):
        return
    old_shapes = {n: old.slots[n].shape for n in old.param_names}
    new_shapes = {n: new.slots[n].shape for n in new.param_names}
    missing = [n for n in new_shapes if n not in old_shapes]
    unexpected = [n for n in old_shapes if n not in new_shapes]
    shapes = [f"{n}: {old_name} {list(old_shapes[n])} vs {new_name} {list(new_shapes[n])}"
              for n in new_shapes if n in old_shapes and old_shapes[n] != new_shapes[n]]
    parts = []
    if missing:
        parts.append(f"missing from the {old_name}: {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected in the {old_name} (not in the {new_name}): {_names(unexpected)}")
    if shapes:
        parts.append(f"shape differences: {_names(shapes)}")
    if not parts:
        parts.append("the same parameters are grouped into different units (the module "
                     f"structure differs): {old_name} {[u.params for u in old.units]} vs "
                     f"{new_name} {[u.params for u in new.units]}")
    raise ValueError(f"the {old_name} was saved from a different model: " + "; ".join(parts)
                     + f". Build the {new_name} with the model_fn that wrote the {old_name}.")


def plan(old_layout: FlatLayout, new_layout: FlatLayout, new_rank: int) -> List[Copy]:
    """The copies that assemble ``new_rank``'s local shard from the old ranks' local shards;
    see [Note: resharding]. Sorted by destination; adjacent copies are merged."""
    check_same_params(old_layout, new_layout)
    if not 0 <= new_rank < new_layout.world_size:
        raise ValueError(f"new_rank={new_rank} is outside the new world size {new_layout.world_size}")
    copies: List[Copy] = []
    for old_unit, new_unit in zip(old_layout.units, new_layout.units):
        lo, hi = new_unit.rank_range(new_rank)
        step = old_unit.shard_numel
        x = lo
        while x < hi:
            src_rank = x // step
            end = min(hi, (src_rank + 1) * step)
            src_start = old_unit.shard_offset + x - src_rank * step
            dst_start = new_unit.shard_offset + x - lo
            last = copies[-1] if copies else None
            if (last and last.src_rank == src_rank and last.src_end == src_start
                    and last.dst_start + last.numel == dst_start):
                copies[-1] = Copy(src_rank, last.src_start, src_start + end - x, last.dst_start)
            else:
                copies.append(Copy(src_rank, src_start, src_start + end - x, dst_start))
            x = end
    return copies


def apply_plan(copies: Sequence[Copy], sources: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
               out: torch.Tensor) -> torch.Tensor:
    """Run ``copies`` from in-memory old shards into ``out`` (1-D, zeroed by the caller)."""
    for c in copies:
        out[c.dst_start:c.dst_start + c.numel].copy_(sources[c.src_rank][c.src_start:c.src_end])
    return out


def _source_rank(new_rank: int, old_world_size: int) -> int:
    return min(new_rank, old_world_size - 1)


def reshard_in_memory(old_layout: FlatLayout, old_states: Sequence[Mapping[str, Any]],
                      new_layout: FlatLayout, new_rank: int) -> Dict[str, Any]:
    """``new_rank``'s state (same keys as the old states) from every old rank's state.

    Sharded keys ("master", "optim.*" 1-D of shard_numel) are resharded; a whole parameter's
    optimizer state goes to its new owner; "scalars" and any other value are deep-copied from
    old rank ``min(new_rank, N - 1)`` (see [Note: resharding])."""
    if len(old_states) != old_layout.world_size:
        raise ValueError(f"got {len(old_states)} old states for an old layout of world size "
                         f"{old_layout.world_size}; pass one state per old rank, in rank order")
    copies = plan(old_layout, new_layout, new_rank)
    keys = [k for k in old_states[0] if not is_owned_key(k)]
    for r, state in enumerate(old_states):
        if {k for k in state if not is_owned_key(k)} != set(keys):
            raise ValueError(f"old rank {r} has keys {sorted(state)} but rank 0 has {sorted(keys)}")
    source = old_states[_source_rank(new_rank, old_layout.world_size)]
    names, wanted = set(new_layout.param_names), set(owned_by(new_layout, new_rank))
    out: Dict[str, Any] = {k: v.detach().clone() for state in old_states for k, v in state.items()
                           if is_owned_key(k) and split_owned_key(k, names)[0] in wanted}
    for key in keys:
        value = old_states[0][key]
        if is_sharded_key(key, value, old_layout.shard_numel):
            shards = [s[key] for s in old_states]
            dst = torch.zeros(new_layout.shard_numel, dtype=value.dtype, device=value.device)
            out[key] = apply_plan(copies, shards, dst)
        elif isinstance(source[key], torch.Tensor):
            out[key] = source[key].detach().clone()
        else:
            out[key] = copy.deepcopy(source[key])
    return out


def load_resharded(path: Union[PathLike, Manifest], new_layout: FlatLayout, new_rank: int,
                   verify: bool = True) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(tensors, scalars) of ``new_rank`` at ``new_layout``'s world size, from a checkpoint saved
    at any world size. Reads only the slices of the old shard files that the plan names, and
    checks each file it opens against the manifest (size, and sha256 when ``verify``).

    ``path``: a step directory (what ``latest_checkpoint`` returns: pass that to every worker,
    so all of them read the same checkpoint), a checkpoint root (follows ``latest``), or a
    loaded Manifest."""
    with CheckpointReader(path, verify=verify) as reader:
        m = reader.manifest
        try:
            check_same_params(reader.layout, new_layout)
        except ValueError as e:
            raise CheckpointError(f"{m.source}: {e}") from None
        copies = plan(reader.layout, new_layout, new_rank)
        by_rank: Dict[int, List[Copy]] = defaultdict(list)
        for c in copies:
            by_rank[c.src_rank].append(c)
        src = _source_rank(new_rank, m.world_size)
        tensors: Dict[str, torch.Tensor] = {}
        for key in m.sharded_keys:
            dst = torch.zeros(new_layout.shard_numel, dtype=dtype_from_code(m.tensors[key]["dtype"]))
            for rank, rank_copies in by_rank.items():
                slices = reader.read_slices(rank, key, [(c.src_start, c.src_end) for c in rank_copies])
                for c, piece in zip(rank_copies, slices):
                    dst[c.dst_start:c.dst_start + c.numel].copy_(piece)
            tensors[key] = dst
        for key in m.rank_keys:
            tensors[key] = reader.shard(src).read(key)
        tensors.update(_owned_state(reader, new_layout, new_rank))
        return tensors, copy.deepcopy(m.scalars[src])


def _owned_state(reader: CheckpointReader, new_layout: FlatLayout, new_rank: int) -> Dict[str, torch.Tensor]:
    """The whole-parameter optimizer state of the parameters ``new_rank`` owns at the new world
    size ([Note: parameter owners] in layout/owners.py), each read from the file of its old owner."""
    owned = reader.manifest.owned_keys
    if not owned:
        return {}
    names = set(new_layout.param_names)
    wanted = set(owned_by(new_layout, new_rank))
    return {key: reader.shard(rank).read(key) for key, rank in owned.items()
            if split_owned_key(key, names)[0] in wanted}
