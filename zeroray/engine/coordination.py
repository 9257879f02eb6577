"""The engine's fetch coordinator, chosen once: none to speak of at stage 0, the publish
coordinator at stages 1-2 (fetch/publish.py), the fetch coordinator at stage 3
(fetch/coordinator.py), each with its parameter access.

Stage 0 holds every parameter in its arena: nothing is gathered, nothing is freed. Its
coordinator is ``NullCoordinator``, which has every method the step calls and does nothing,
so the step never asks which stage it runs.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from zeroray.comm.buckets import GradBuckets
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig
from zeroray.fetch.factory import Coordinator
from zeroray.fetch.factory import build_coordinator as build_fetch_coordinator
from zeroray.fetch.hooks import HookedModules
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

    def pack(self, t: torch.Tensor):
        return t

    def unpack(self, obj):
        return obj

    def remove(self) -> None:
        pass


def build_coordinator(policy: StagePolicy, model: torch.nn.Module, layout: FlatLayout, storage, group: Group,
                      waiter: Waiter, zero: ZeroConfig, named: Dict[str, torch.nn.Parameter],
                      reducer: GradBuckets) -> Coordinator:
    """The coordinator of ``policy``'s stage (a ``NullCoordinator`` at stage 0), with its
    parameters' access class installed where it needs one. Built before any user callback may
    read a parameter; its ``remove`` also gives the parameters their plain class back.

    The reducer's part in stage 3's fetch protocol goes in as the coordinator's callbacks:
    without independent channels (NCCL) a negotiated micro-batch holds its reductions until
    ``finish`` (comm/buckets.py); with them, a computed micro-batch launches its reductions
    still short of gradients (what this rank did not produce counts as zero) before it ends
    its fetch protocol (FetchCoordinator._launch_before_done says why)."""
    independent = group.independent_channels
    coordinator = build_fetch_coordinator(
        policy, zero, storage.units, storage.gatherer, group, waiter, HookedModules(*hooked_modules(model, layout)),
        {n: named[n] for n in layout.param_names},
        on_negotiate=(lambda: None) if independent else reducer.hold_until_finish,
        before_done_rounds=reducer.launch_all if independent else (lambda: None))
    return NullCoordinator() if coordinator is None else coordinator


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
