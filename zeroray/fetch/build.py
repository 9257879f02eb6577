"""Building the coordinator of a stage: the one place that knows which coordinator each stage has.

- Stage 0 holds every parameter in its arena: nothing is gathered, nothing is freed. Its
  coordinator is the lifecycle alone (``Coordinator``, fetch/lifecycle.py).
- Stages 1-2 only publish the optimizer's update: ``UpdatePublisher`` (fetch/publish.py).
- Stage 3 fetches and frees every unit around its use: ``UnitFetcher`` (fetch/unit_fetcher.py).
  It is also the stage's ``UnitEvents``, which the engine installs into its gradient hooks and
  its saved-tensor hooks; stages 0-2 have none, and nothing is installed there.

The engine drives whichever it gets through the same lifecycle, so the step never asks which
stage it runs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from zeroray.comm.buckets import GradBuckets
from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig
from zeroray.fetch.hooks import HookedModules
from zeroray.fetch.lifecycle import Coordinator, UnitEvents
from zeroray.fetch.publish import UpdatePublisher
from zeroray.fetch.unit import Units
from zeroray.fetch.unit_fetcher import UnitFetcher
from zeroray.layout.arena import FlatLayout
from zeroray.layout.stage import StagePolicy


def build_coordinator(policy: StagePolicy, zero: ZeroConfig, model: torch.nn.Module, layout: FlatLayout,
                      units: Units, gatherer: UnitGatherer, group: Group, waiter: Waiter,
                      named: Dict[str, torch.nn.Parameter], reducer: GradBuckets
                      ) -> Tuple[Coordinator, Optional[UnitEvents]]:
    """The coordinator of ``policy``'s stage, hooked into ``model``'s modules and seeing the
    reads of its trainable parameters (of ``named``) where it needs to, and the stage's
    ``UnitEvents`` (stage 3's coordinator itself; None at stages 0-2). Built before any user
    callback may read a parameter; its ``remove`` gives the parameters their plain class back.

    The reducer's part in stage 3's fetch protocol goes in as the fetcher's callbacks: without
    independent channels (NCCL) a negotiated micro-batch holds its reductions until ``finish``
    (comm/buckets.py); with them, a computed micro-batch launches its reductions still short of
    gradients (what this rank did not produce counts as zero) before it ends its fetch protocol
    (``UnitFetcher._launch_before_done`` says why)."""
    if policy.reshard_after_use:
        independent = group.independent_channels
        fetcher = UnitFetcher(
            units, gatherer, group, waiter, hooked_modules(model, layout), _trained(named, layout),
            prefetch=zero.prefetch, prefetch_bytes=zero.prefetch_bytes, max_live_bytes=zero.max_live_bytes,
            reuse_distance=zero.reuse_distance,
            on_negotiate=(lambda: None) if independent else reducer.hold_until_finish,
            before_done_rounds=reducer.launch_all if independent else (lambda: None))
        return fetcher, fetcher
    if policy.keeps_param_shard:
        return UpdatePublisher(units, gatherer, waiter, hooked_modules(model, layout), _trained(named, layout)), None
    return Coordinator(), None


def _trained(named: Dict[str, torch.nn.Parameter], layout: FlatLayout) -> Dict[str, torch.nn.Parameter]:
    return {n: named[n] for n in layout.param_names}


def hooked_modules(model: torch.nn.Module, layout: FlatLayout) -> HookedModules:
    """Each module object whose forward needs units (once, under its first name) and those units."""
    modules: List[torch.nn.Module] = []
    names: List[str] = []
    needs: List[Tuple[int, ...]] = []
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
    return HookedModules(modules, names, needs)
