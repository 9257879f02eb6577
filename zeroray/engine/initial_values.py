"""The initial values of this rank's shard, before the parameters are bound to their units.

Stage 3 and mixed precision at stages 0-2 keep an fp32 master of their own (engine/storage.py,
[Note: stage data flow]); it starts as this rank's slice of every trainable parameter (stage 0:
all of every one, ``initial_full``), in fp32 as the model built it, never read back from the
compute-dtype copy (that would round the master to the compute dtype before the first step). A model
built sharded (construct/sharded_init.py) already holds only those slices (``kept``), laid out
as the shard in one arena that is adopted rather than copied; a model built whole is cut.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from zeroray.layout.arena import FlatLayout

# name -> (lo, hi, values): the slice [lo, hi) of each trainable parameter a sharded build kept
Kept = Optional[Dict[str, Tuple[int, int, torch.Tensor]]]


def initial_shard(layout: FlatLayout, named: Dict[str, torch.nn.Parameter], kept: Kept, rank: int,
                  device: torch.device) -> torch.Tensor:
    """This rank's fp32 shard of the initial values (1D), from the kept slices of a sharded
    build (which arrive laid out as the shard: that arena is adopted, not copied) or from
    the whole parameters."""
    shard = adopt_kept_arena(layout, kept, rank, device) if kept is not None else None
    if shard is None:
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
    for name in layout.param_names:
        piece, lo, hi = layout.param_shard_view(shard, name, rank)
        if hi > lo:
            # pop: each kept slice that is not in place is freed once copied
            values = kept.pop(name)[2] if kept is not None else named[name].detach().reshape(-1)[lo:hi]
            if values.data_ptr() != piece.data_ptr():
                piece.copy_(values.float())
    return shard


def initial_full(layout: FlatLayout, named: Dict[str, torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """The fp32 initial values of every trainable parameter in the full arena's coordinates (1D,
    zero padding): stage 0's master in mixed precision."""
    full = torch.zeros(layout.full_numel, dtype=torch.float32, device=device)
    for name in layout.param_names:
        slot = layout.slots[name]
        start = layout.units[slot.unit].full_offset + slot.offset
        full[start:start + slot.numel].copy_(named[name].detach().reshape(-1).float())
    return full


def adopt_kept_arena(layout: FlatLayout, kept: Dict[str, Tuple[int, int, torch.Tensor]], rank: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """The fp32 arena in which a sharded build left this rank's slices, laid out as the local
    shard ([Note: sharded construction] in construct/sharded_init.py), as a 1D tensor with zero padding;
    None when the slices are not there (another dtype or device), and they are then copied."""
    held = [v for lo, hi, v in kept.values() if hi > lo]
    if not held or any(v.dtype != torch.float32 for v in held):
        return None
    storage = held[0].untyped_storage()
    if storage.device != device or storage.nbytes() != layout.shard_numel * torch.float32.itemsize:
        return None
    shard = torch.empty(0, dtype=torch.float32, device=device).set_(storage, 0, (layout.shard_numel,))
    with torch.no_grad():
        for unit in layout.units:  # the tail of each unit's slice is padding, never written
            lo, hi = unit.rank_range(rank)
            shard[unit.shard_offset + hi - lo:unit.shard_offset + unit.shard_numel].zero_()
    return shard
