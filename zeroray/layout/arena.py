"""The flat layout of the trainable parameters (M_D) and the range arithmetic of shards.

[Note: flat layout]
Trainable parameters are grouped into *units*, the module subtrees a wrap policy chooses
(see [Note: wrap policy] in layout/wrap.py), in ``model.named_modules()`` order. A parameter shared
by several modules (tied weights) belongs to the first module that owns it and is stored
once; a module elsewhere that uses it gathers that unit too (``module_units``).

Each unit is one flat vector of ``numel`` elements (its parameters back to back, in
registration order), padded with zeros to ``padded = ceil(numel / W) * W`` so that it splits
evenly: rank ``r`` owns elements ``[r * shard_numel, (r + 1) * shard_numel)`` of every unit.
A rank's local shard is the concatenation of its slice of every unit, in unit order, so all
long-lived per-rank tensors (parameter shard, gradient shard, optimizer state) are single
contiguous arenas of ``shard_numel`` elements, and the full (gathered) parameters of stages
0-2 are one contiguous arena of ``full_numel`` elements.

Sharding per unit (rather than cutting one global vector into W pieces) is what lets stage 3
gather exactly one module's parameters with one all-gather in which every rank contributes
the same number of elements.

Coordinates: "unit coordinates" count elements inside one unpadded unit; "logical
coordinates" count elements across the unpadded units laid end to end. Both are independent
of the world size, which is what resharding N -> M (checkpoint/reshard.py) relies on.

This module is pure: it reads names, shapes and dtypes off a module and does arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from zeroray.layout.wrap import WrapPolicy


@dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives: ``unit`` and its range in unit coordinates."""

    name: str
    unit: int
    offset: int
    numel: int
    shape: Tuple[int, ...]
    aliases: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Unit:
    """One module's trainable parameters as one flat, padded vector."""

    index: int
    module: str
    params: Tuple[str, ...]
    numel: int
    padded: int
    shard_numel: int
    shard_offset: int  # where this unit's slice starts in a rank's local shard
    full_offset: int   # where this unit starts in the full (gathered) arena

    def rank_range(self, rank: int) -> Tuple[int, int]:
        """The unpadded elements ``[lo, hi)`` of this unit that ``rank`` owns (may be empty)."""
        lo = min(rank * self.shard_numel, self.numel)
        hi = min((rank + 1) * self.shard_numel, self.numel)
        return lo, hi


def overlap(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> Tuple[int, int]:
    """The intersection ``[lo, hi)`` of two ranges; empty when ``hi <= lo``."""
    return max(a_lo, b_lo), min(a_hi, b_hi)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FlatLayout:
    """The unit table for one model at one world size; see [Note: flat layout]."""

    def __init__(self, unit_specs: Sequence[Tuple[str, Sequence[Tuple[str, Tuple[int, ...]]]]],
                 world_size: int, aliases: Optional[Dict[str, Sequence[str]]] = None,
                 module_uses: Optional[Dict[str, Sequence[str]]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.units: List[Unit] = []
        self.slots: Dict[str, ParamSlot] = {}
        aliases = aliases or {}
        shard_offset = 0
        full_offset = 0
        for index, (module, params) in enumerate(unit_specs):
            offset = 0
            names = []
            for name, shape in params:
                shape = tuple(int(s) for s in shape)
                numel = 1
                for s in shape:
                    numel *= s
                slot = ParamSlot(name, index, offset, numel, shape, tuple(aliases.get(name, ())))
                self.slots[name] = slot
                for alias in slot.aliases:
                    self.slots[alias] = slot
                names.append(name)
                offset += numel
            padded = max(_ceil_div(offset, world_size), 1) * world_size
            unit = Unit(index, module, tuple(names), offset, padded, padded // world_size,
                        shard_offset, full_offset)
            self.units.append(unit)
            shard_offset += unit.shard_numel
            full_offset += padded
        self.shard_numel = shard_offset  # elements of one rank's local shard
        self.full_numel = full_offset    # elements of the full padded arena
        self.numel = sum(u.numel for u in self.units)  # unpadded trainable elements
        # module qualified name -> units whose parameters it uses directly (its own and tied ones)
        self.module_units: Dict[str, Tuple[int, ...]] = {}
        for module, names in (module_uses or {u.module: u.params for u in self.units}).items():
            self.module_units[module] = tuple(sorted({self.slots[n].unit for n in names}))

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_module(cls, model: torch.nn.Module, world_size: int, wrap: "WrapPolicy" = "module") -> "FlatLayout":
        """Units from ``model``'s modules by the wrap policy (see [Note: wrap policy] in layout/wrap.py);
        frozen parameters (requires_grad=False) stay out."""
        from zeroray.layout.wrap import layout_specs

        unit_specs, aliases, module_uses = layout_specs(model, wrap)
        return cls(unit_specs, world_size, aliases, module_uses)

    def with_world_size(self, world_size: int) -> "FlatLayout":
        """The same units laid out for another number of workers."""
        return FlatLayout(self.unit_specs(), world_size, self.aliases(), self.module_uses())

    def unit_specs(self) -> List[Tuple[str, List[Tuple[str, Tuple[int, ...]]]]]:
        return [(u.module, [(n, self.slots[n].shape) for n in u.params]) for u in self.units]

    def aliases(self) -> Dict[str, List[str]]:
        return {u_name: list(self.slots[u_name].aliases)
                for u in self.units for u_name in u.params if self.slots[u_name].aliases}

    def module_uses(self) -> Dict[str, List[str]]:
        return {m: [n for i in idx for n in self.units[i].params] for m, idx in self.module_units.items()}

    # --- queries ---------------------------------------------------------------------------

    @property
    def param_names(self) -> List[str]:
        """Canonical names (first occurrence of each tied parameter), in layout order."""
        return [n for u in self.units for n in u.params]

    def logical_offsets(self) -> List[int]:
        """Start of each unit in logical (unpadded, world-size independent) coordinates."""
        out, acc = [], 0
        for u in self.units:
            out.append(acc)
            acc += u.numel
        return out

    def param_shard_range(self, name: str, rank: int) -> Tuple[int, int, int]:
        """(start, lo, hi): ``rank`` holds the flat elements ``[lo, hi)`` of parameter ``name``
        (possibly none: ``hi == lo == 0``) at offset ``start`` of its local shard."""
        slot = self.slots[name]
        unit = self.units[slot.unit]
        u_lo, u_hi = unit.rank_range(rank)
        lo, hi = overlap(u_lo, u_hi, slot.offset, slot.offset + slot.numel)
        if hi <= lo:
            return unit.shard_offset, 0, 0
        return unit.shard_offset + lo - u_lo, lo - slot.offset, hi - slot.offset

    def param_shard_view(self, shard: torch.Tensor, name: str, rank: int) -> Tuple[torch.Tensor, int, int]:
        """The part of parameter ``name`` held in ``rank``'s local ``shard``, flat, with the
        range ``[lo, hi)`` of the parameter's flat elements it covers (possibly empty)."""
        start, lo, hi = self.param_shard_range(name, rank)
        return shard[start:start + hi - lo], lo, hi

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "units": self.unit_specs(),
                "aliases": self.aliases(), "module_uses": self.module_uses()}

    @classmethod
    def from_dict(cls, d: dict, world_size: Optional[int] = None) -> "FlatLayout":
        specs = [(m, [(n, tuple(s)) for n, s in params]) for m, params in d["units"]]
        return cls(specs, world_size or d["world_size"], d.get("aliases"), d.get("module_uses"))

    def same_params_as(self, other: "FlatLayout") -> bool:
        return self.unit_specs() == other.unit_specs()
