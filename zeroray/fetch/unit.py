"""The life of one unit's parameters: one concept, like FSDP2's ``FSDPParamGroup``.

A *unit* (see [Note: wrap policy] in layout/wrap.py) is a group of parameters gathered with one
collective and reduced through the same buckets. Every trainable parameter of the model
is, for its whole life, a view into the full buffer of its unit (see [Note: flat layout] in
layout/arena.py). ``FlatUnit`` owns that buffer, this rank's slice of it (the shard), its state,
the gather in flight into it, and the count of gradients still to come in backward.
``Units`` holds them all and binds the model's parameters to them.

- Persistent units (stages 0-2, [Note: stage policy] in layout/stage.py): all full buffers are
  slices of one contiguous arena of ``layout.full_numel`` elements (M_D), allocated once.
- Stage 3: each unit has its own buffer whose *storage* is freed (resized to 0 bytes) while
  the unit is SHARDED and re-allocated in place before a gather. On CPU its memory comes from
  the engine's ``UnitPool`` instead, and goes back to it ([Note: unit pool] in memory/unit_pool.py).

[Note: storage resize]
Freeing by ``untyped_storage().resize_(0)`` rather than dropping the tensor keeps every
view alive and valid across the free/alloc cycle: the parameter views, and the views that
autograd saved for backward (``weight.t()`` of a linear layer, say). Once the storage is
re-allocated and re-gathered, those saved views read the gathered values again, so backward
needs no re-binding. This is the technique of FSDP's ``_free_storage``/``_alloc_storage``.
"""
from __future__ import annotations

import enum
from typing import Callable, Dict, Iterator, List, Optional

import torch

from zeroray.layout.arena import FlatLayout, Unit
from zeroray.memory.unit_pool import UnitPool


class UnitState(enum.Enum):
    """Which tensors of a unit hold memory.

    SHARDED: only the owner's slice (in the local parameter shard); the full buffer's
        storage is 0 bytes (stage 3) or holds values that are out of date (stages 1-2 just
        after the optimizer step, before the gather that publishes the update starts).
    GATHERING: full buffer allocated, an all-gather into it in flight; not yet readable.
    GATHERED: the full buffer holds all of the unit's parameters; the parameter views are valid.
    """

    SHARDED = 0
    GATHERING = 1
    GATHERED = 2


class FlatUnit:
    """One unit: its full buffer (compute dtype, 1D of ``spec.padded`` elements), its state,
    the gather in flight into it, and its gradients' progress in backward."""

    def __init__(self, spec: Unit, full: torch.Tensor, persistent: bool, state: UnitState) -> None:
        self.spec, self.full, self.persistent, self.state = spec, full, persistent, state  # full: 1D
        self.index = spec.index
        self.nbytes = spec.padded * full.element_size()
        self.handle = None          # the GatherHandle filling ``full`` while GATHERING
        self.grads_pending = 0      # parameters whose gradient backward has not produced yet

    def alloc(self, pool: Optional[UnitPool] = None) -> torch.Tensor:
        """Re-allocate the full buffer in place before a gather writes into it (from ``pool``'s
        mappings where given)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            if pool is not None:
                pool.fill(storage, self.nbytes)
            else:
                storage.resize_(self.nbytes)
        return self.full

    def free(self, pool: Optional[UnitPool] = None) -> None:
        """SHARDED: release the full buffer's memory (to ``pool``, where it came from); see
        [Note: storage resize]."""
        assert not self.persistent and self.handle is None, (self.index, self.state)
        storage = self.full.untyped_storage()
        if storage.nbytes():
            if pool is not None:
                pool.take_back(storage)
            else:
                storage.resize_(0)
        self.state = UnitState.SHARDED

    def start_gather(self, handle) -> None:
        self.handle, self.state = handle, UnitState.GATHERING

    def gathered(self) -> None:
        self.handle, self.state = None, UnitState.GATHERED


class Units:
    """Every unit of the layout, and the binding of the model's parameters to their buffers."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, persistent: bool,
                 pool: Optional[UnitPool] = None) -> None:
        """``pool``: where a stage-3 buffer's memory comes from between gathers (on CPU: [Note:
        unit pool] in memory/unit_pool.py); without it, the device's allocator."""
        self.layout, self.dtype, self.device, self.persistent = layout, dtype, device, persistent
        self.pool = pool
        self.arena: Optional[torch.Tensor] = None  # 1D, full_numel (persistent units)
        self.units: List[FlatUnit] = []
        if persistent:
            # Not zeros: its pages are touched as bind() copies each parameter in and the model's
            # own copy of that parameter is freed, so construction never holds the model twice.
            self.arena = torch.empty(layout.full_numel, dtype=dtype, device=device)
            with torch.no_grad():
                for u in layout.units:
                    self.arena[u.full_offset + u.numel:u.full_offset + u.padded].zero_()  # padding
            for u in layout.units:
                self.units.append(FlatUnit(u, self.arena[u.full_offset:u.full_offset + u.padded], True,
                                           UnitState.GATHERED))
        else:
            # Created SHARDED, one unit at a time: the full model is never allocated at once.
            for u in layout.units:
                buf = torch.empty(u.padded, dtype=dtype, device=device)
                buf.untyped_storage().resize_(0)
                self.units.append(FlatUnit(u, buf, False, UnitState.SHARDED))
        self._ptr_to_unit: Dict[int, int] = {}  # data_ptr of an allocated stage-3 buffer -> unit

    def __getitem__(self, index: int) -> FlatUnit:
        return self.units[index]

    def __iter__(self) -> Iterator[FlatUnit]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    def param_view(self, name: str) -> torch.Tensor:
        slot = self.layout.slots[name]
        return self.units[slot.unit].full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def bind(self, params: Dict[str, torch.nn.Parameter], copy_values: bool = True) -> None:
        """Make every trainable parameter a view into its unit's buffer (values copied in, unless
        the model was built sharded and holds no values; the shard has them)."""
        assert copy_values or not self.persistent, "the persistent arena is filled by bind"
        with torch.no_grad():
            for unit in self.units:
                if not self.persistent:
                    unit.alloc()  # views can only be cut from allocated storage
                for name in unit.spec.params:
                    p = params[name]
                    view = self.param_view(name)
                    if copy_values:
                        view.copy_(p.detach().to(self.dtype))
                    p.data = view
                if not self.persistent:
                    unit.free()  # the local shard holds the values; one unit at a time

    def expect_grads(self) -> None:
        """Before a backward: every unit awaits a gradient for each of its parameters."""
        for unit in self.units:
            unit.grads_pending = len(unit.spec.params)

    def grad_arrived(self, index: int) -> bool:
        """One gradient of unit ``index`` reached the reducer; True once it was the unit's last."""
        unit = self.units[index]
        unit.grads_pending -= 1
        return unit.grads_pending == 0

    # --- stage 3: buffers that come and go ------------------------------------------------

    def alloc(self, index: int) -> torch.Tensor:
        full = self.units[index].alloc(self.pool)
        self._ptr_to_unit[full.untyped_storage().data_ptr()] = index
        return full

    def free(self, index: int, waiter: Callable) -> None:
        """Release unit ``index``'s full buffer, after the gather still writing into it (if any)."""
        unit = self.units[index]
        if unit.state is not UnitState.SHARDED:
            self.wait(index, waiter)  # never free memory a collective is still writing into
            self._ptr_to_unit.pop(unit.full.untyped_storage().data_ptr(), None)
            unit.free(self.pool)

    def unit_at(self, data_ptr: int) -> Optional[int]:
        """The unit whose allocated full buffer starts at ``data_ptr`` (saved-tensor tagging)."""
        return self._ptr_to_unit.get(data_ptr)

    def gathered_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.state is not UnitState.SHARDED)

    def holding(self) -> List[int]:
        """Units whose full buffer holds memory (stage 3) or a gather in flight."""
        return [u.index for u in self.units if u.state is not UnitState.SHARDED]

    def wait(self, index: int, waiter: Callable) -> int:
        """Finish the gather that fills unit ``index`` (all units it covers become GATHERED);
        how many units that finished (0: it was not gathering)."""
        unit = self.units[index]
        finished = 0
        if unit.state is UnitState.GATHERING:
            handle = unit.handle
            waiter(handle)
            for v in handle.units:
                if self.units[v].handle is handle:
                    self.units[v].gathered()
                    finished += 1
        return finished
