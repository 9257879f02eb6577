"""Where gradients leave autograd: one post-accumulate-grad hook per trainable parameter.

A hook records that its parameter was used ([Note: unused parameters] in engine/flat_pieces.py)
and, when the reducer accepts this backward's gradients, hands the gradient to the coalescing
buckets (comm/buckets.py) and drops it; once a unit's last gradient is in, stage 3's coordinator
hears it (``UnitEvents.on_grads_done``, fetch/lifecycle.py) and may free the unit; stages 0-2 have
no one to tell. Stages 0-1 accumulating over micro-batches leave the gradient to
autograd until the last micro-batch ([Note: stage data flow] in engine/storage.py).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from zeroray.comm.buckets import GradBuckets
from zeroray.fetch.lifecycle import UnitEvents
from zeroray.fetch.unit import Units
from zeroray.layout.arena import FlatLayout


class GradIntake:
    """The hooks of every trainable parameter, and which of them produced a gradient this step.
    ``unit_events``: stage 3's, told when a unit's last gradient is in (None at stages 0-2)."""

    def __init__(self, named: Dict[str, torch.nn.Parameter], layout: FlatLayout, units: Units,
                 reducer: GradBuckets, unit_events: Optional[UnitEvents]) -> None:
        self.layout, self.units, self.reducer, self.unit_events = layout, units, reducer, unit_events
        self.used = dict.fromkeys(layout.param_names, 0.0)
        self._trained = {name: named[name] for name in layout.param_names}
        self._hooks: List = []
        intake = weakref.ref(self)  # autograd holds the hooks from C++: no strong cycle through them
        for name in layout.param_names:
            unit = layout.slots[name].unit

            def hook(p: torch.Tensor, name=name, unit=unit) -> None:
                owner = intake()
                if owner is not None:
                    owner._grad_ready(name, unit, p)
            self._hooks.append(named[name].register_post_accumulate_grad_hook(hook))

    def begin_step(self) -> None:
        self.used = dict.fromkeys(self.used, 0.0)

    def _grad_ready(self, name: str, unit: int, p: torch.Tensor) -> None:
        self.used[name] = 1.0  # it has a gradient: used ([Note: unused parameters] in engine/flat_pieces.py)
        if not self.reducer.accepting:
            return  # stages 0-1 accumulating: autograd keeps the full gradient until the last micro-batch
        self.reducer.add_grad(name, p.grad)
        p.grad = None
        if self.units.grad_arrived(unit) and self.unit_events is not None:
            self.unit_events.on_grads_done(unit)

    def reduce_accumulated(self) -> None:
        """Stages 0-1, last micro-batch: a parameter used in an earlier micro-batch but not in
        this one holds its accumulated gradient still (its hook did not fire now): reduce it too."""
        for name, p in self._trained.items():
            if p.grad is not None:
                self._grad_ready(name, self.layout.slots[name].unit, p)

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
