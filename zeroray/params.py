"""The life of the parameters' full (gathered) buffers: one concept, like FSDP2's _fsdp_param.py.

Every trainable parameter of the model is, for its whole life, a view into the full buffer
of its unit (see [Note: flat layout] in arena.py). What changes between stages is whether
that buffer keeps its memory:

- stages 0-2 (``persistent=True``): all units' full buffers are slices of one contiguous
  arena of ``layout.full_numel`` elements (M_D), allocated once;
- stage 3 (``persistent=False``): each unit has its own buffer whose *storage* is freed
  (resized to 0 bytes) while the unit is SHARDED and re-allocated in place before a gather.

[Note: storage resize]
Freeing by ``untyped_storage().resize_(0)`` rather than dropping the tensor keeps every
view alive and valid across the free/alloc cycle: the parameter views, and the views that
autograd saved for backward (``weight.t()`` of a linear layer, say). Once the storage is
re-allocated and re-gathered, those saved views read the gathered values again, so backward
needs no re-binding. This is the technique of FSDP's ``_free_storage``/``_alloc_storage``.
"""
from __future__ import annotations

import enum
from typing import Dict, List

import torch

from zeroray.arena import FlatLayout


class UnitState(enum.Enum):
    """Which tensors of a unit hold memory.

    SHARDED: only the owner's slice (in the local parameter shard); full buffer storage is 0 B.
    GATHERING: full buffer allocated, an all-gather into it in flight; not yet readable.
    GATHERED: full buffer holds all of the unit's parameters; the parameter views are valid.
    """

    SHARDED = 0
    GATHERING = 1
    GATHERED = 2


class UnitBuffers:
    """The full buffer of every unit, and the binding of the model's parameters to it."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
                 persistent: bool) -> None:
        self.layout, self.dtype, self.device, self.persistent = layout, dtype, device, persistent
        self.arena = None
        self.full: List[torch.Tensor] = []  # per unit, 1D of unit.padded elements
        if persistent:
            self.arena = torch.zeros(layout.full_numel, dtype=dtype, device=device)  # 1D
            self.full = [self.arena[u.full_offset:u.full_offset + u.padded] for u in layout.units]
            self.state = [UnitState.GATHERED] * len(layout.units)
        else:
            # Created SHARDED, one unit at a time: the full model is never allocated at once.
            self.full = []
            for u in layout.units:
                buf = torch.empty(u.padded, dtype=dtype, device=device)
                buf.untyped_storage().resize_(0)
                self.full.append(buf)
            self.state = [UnitState.SHARDED] * len(layout.units)
        elem = torch.tensor([], dtype=dtype).element_size()
        self._nbytes = [u.padded * elem for u in layout.units]

    def unit_bytes(self, unit: int) -> int:
        return self._nbytes[unit]

    def param_view(self, name: str) -> torch.Tensor:
        slot = self.layout.slots[name]
        return self.full[slot.unit][slot.offset:slot.offset + slot.numel].view(slot.shape)

    def bind(self, params: Dict[str, torch.nn.Parameter], copy_values: bool = True) -> None:
        """Make every trainable parameter a view into its unit's buffer (values copied in, unless
        the model was built sharded and holds no values; the shard has them)."""
        with torch.no_grad():
            for unit in self.layout.units:
                if not self.persistent:
                    self.alloc(unit.index)  # views can only be cut from allocated storage
                for name in unit.params:
                    p = params[name]
                    view = self.param_view(name)
                    if copy_values:
                        view.copy_(p.detach().to(self.dtype))
                    p.data = view
                if not self.persistent:
                    self.free(unit.index)  # the local shard holds the values; one unit at a time

    def free(self, unit: int) -> None:
        """SHARDED: release the full buffer's memory; see [Note: storage resize]."""
        assert not self.persistent
        if self.full[unit].untyped_storage().nbytes():
            self.full[unit].untyped_storage().resize_(0)
        self.state[unit] = UnitState.SHARDED

    def alloc(self, unit: int) -> torch.Tensor:
        """Re-allocate the full buffer in place before a gather writes into it."""
        assert not self.persistent
        buf = self.full[unit]
        storage = buf.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes[unit])
        return buf

    def gathered_bytes(self) -> int:
        return sum(n for n, s in zip(self._nbytes, self.state) if s is not UnitState.SHARDED)

    def storage_ptr_to_unit(self) -> Dict[int, int]:
        """data_ptr of each allocated buffer -> unit (to recognise tensors saved for backward)."""
        return {self.full[i].untyped_storage().data_ptr(): i
                for i, s in enumerate(self.state) if s is not UnitState.SHARDED}
