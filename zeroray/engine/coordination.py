"""The engine's fetch coordinator, chosen once: none to speak of at stage 0, the fetch coordinator
(fetch/coordinator.py) with its parameter access at stages 1-3.

Stage 0 holds every parameter in its arena: nothing is gathered, nothing is freed. Its
coordinator is ``NullCoordinator``, which has every method the step calls and does nothing,
so the step never asks which stage it runs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from zeroray.comm.buckets import GradBuckets
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig
from zeroray.fetch.access import ParameterAccess
from zeroray.fetch.coordinator import FetchCoordinator
from zeroray.layout.arena import FlatLayout
from zeroray.layout.stage import StagePolicy


class NullCoordinator:
    """Stage 0's coordinator: every parameter is always resident, so every event is nothing."""

    def __init__(self) -> None:
        self.records: List[object] = []  # no micro-batch records a trace
        self.stats: Dict[str, float] = {}

    def status(self) -> Tuple[float, float, float]:
        """(left the plan, events, digest) for the step's status all-reduce: no trace, nothing left."""
        return 0.0, 0.0, 0.0

    def enter_module(self, module: torch.nn.Module) -> bool:
        return False  # no module is hooked

    def begin_step(self) -> None:
        pass

    def begin_micro_batch(self, micro_batch: int) -> None:
        pass

    def begin_backward(self) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    def abort_micro_batch(self) -> None:
        pass

    def end_micro_batch(self) -> None:
        pass

    def end_step(self, failed: bool, any_exit: bool, agreed: bool) -> None:
        pass

    def begin_inference(self) -> None:
        pass

    def end_inference(self) -> None:
        pass

    def publish(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def on_grads_done(self, unit: int) -> None:
        pass

    def on_access(self, name: str, unit: int) -> None:
        pass

    def exit_module(self, module: torch.nn.Module) -> None:
        pass

    def remove(self) -> None:
        pass


def build_coordinator(policy: StagePolicy, model: torch.nn.Module, layout: FlatLayout, storage, group: Group,
                      waiter: Waiter, zero: ZeroConfig, named: Dict[str, torch.nn.Parameter],
                      reducer: GradBuckets) -> Tuple[object, Optional[ParameterAccess]]:
    """(the coordinator, the trainable parameters' access class or None at stage 0). Built
    before any user callback may read a parameter."""
    if not policy.keeps_param_shard:
        return NullCoordinator(), None
    modules, names, needs = hooked_modules(model, layout)
    coordinator = FetchCoordinator(
        storage.units, storage.gatherer, group, waiter, modules, names, needs,
        reshard=policy.reshard_after_use, prefetch=zero.prefetch, prefetch_bytes=zero.prefetch_bytes,
        max_live_bytes=zero.max_live_bytes, reuse_distance=zero.reuse_distance)
    trainable = {n: named[n] for n in layout.param_names}
    access = ParameterAccess(trainable, {n: layout.slots[n].unit for n in trainable}, coordinator.on_access)
    wire_coordinator(coordinator, reducer, access, group, policy)
    if policy.reshard_after_use:
        access.install()
    return coordinator, access


def wire_coordinator(coordinator: FetchCoordinator, reducer: GradBuckets, access: ParameterAccess, group: Group,
                     policy: StagePolicy) -> None:
    """WIRING TO MOVE INTO THE CONSTRUCTORS: the only place that sets the coordinator's callbacks
    after it was built. When the coordinator is split (the stage-3 one and the stages 1-2
    publish), these become their constructors' arguments and this function goes.

    - ``on_negotiate``: without independent channels a negotiated micro-batch reduces after its
      rounds (comm/buckets.py), so the reducer holds its launches until ``finish``.
    - ``before_done_rounds``: a stage-3 micro-batch is computed: launch its reductions still
      short of gradients (what this rank did not produce counts as zero) before it ends its
      fetch protocol (FetchCoordinator._launch_before_done says why). Where all collectives
      share one order (NCCL, [Note: channels]) they stay where they were, after it: no wait
      blocks there.
    - ``on_publish``/``on_resident`` (stages 1-2): the access class is on only while a publish
      is in flight ([Note: reads during a publish] in fetch/coordinator.py)."""
    if group.independent_channels:
        coordinator.before_done_rounds = reducer.launch_all
    else:
        coordinator.on_negotiate = reducer.hold_until_finish
    if not policy.reshard_after_use:
        coordinator.on_publish, coordinator.on_resident = access.install, access.suspend


def hooked_modules(model: torch.nn.Module, layout: FlatLayout
                   ) -> Tuple[List[torch.nn.Module], List[str], List[Tuple[int, ...]]]:
    """Each module object whose forward needs units (once, under its first name) and those units."""
    modules, names, needs = [], [], []
    by_name = dict(model.named_modules(remove_duplicate=False))
    index_of: Dict[int, int] = {}
    for mname, unit_ids in layout.module_units.items():
        module = by_name[mname]
        if id(module) in index_of:  # one module object registered under two names
            i = index_of[id(module)]
            needs[i] = tuple(sorted(set(needs[i]) | set(unit_ids)))
            continue
        index_of[id(module)] = len(modules)
        modules.append(module)
        names.append(mname)
        needs.append(tuple(unit_ids))
    return modules, names, needs
