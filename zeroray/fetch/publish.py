"""The stages 1-2 coordinator: publishing the optimizer's update into the resident parameters.

At stages 1-2 every unit's full buffer is a slice of the persistent arena (fetch/unit.py) and is
never freed; after the optimizer step each rank holds the update of its shard only, and the
all-gathers that publish it to every rank are the only fetches there are. This coordinator
starts them (``publish``) and waits for each where it is first needed. Stage 3 has a
coordinator of its own (fetch/coordinator.py); both offer the engine the same methods.

[Note: deferred publish]
After the optimizer step the stage 1-2 all-gathers of the updated parameters are only
launched; each unit's gather is waited for where it is first needed in the next forward, so
the gathers run while the driver sends the next batch and while the earlier modules
compute (the paper's overlap, as stage 3's prefetch does). ``flush`` finishes whatever is
still in flight; every path that reads or rewrites the full parameters calls it first. The
staging buffers of the publish are released once its last gather was waited for
(comm/gather.py, ``release_idle``).

[Note: reads during a publish]
At stages 1-2 a parameter is only unsafe to read while its unit's publish gather is writing
into it: from ``publish`` until that gather was waited for. Only then does the coordinator need
to see reads made outside the hooked modules ([Note: parameter access] in fetch/access.py): it
installs the parameters' access class when a publish starts and suspends it once every unit's
gather was waited for (in the first forward, at the latest in ``flush`` or at the end of the
micro-batch), so the rest of the step's ops on parameters run as on plain ones. Stage 3 keeps
it installed throughout.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Channel
from zeroray.comm.waiter import Waiter
from zeroray.fetch.access import ParameterAccess
from zeroray.fetch.hooks import HookedModules, ModuleHooks
from zeroray.fetch.unit import Units, UnitState


class PublishCoordinator:
    """Starts the publish gathers and waits for each unit's where it is first needed; see the
    module docstring. ``hooked``: the modules whose forward needs units; ``params``: the
    trainable parameters (name -> parameter) whose reads it sees while a publish is in flight."""

    def __init__(self, units: Units, gatherer: UnitGatherer, waiter: Waiter, hooked: HookedModules,
                 params: Dict[str, torch.nn.Parameter]) -> None:
        self.units, self.gatherer, self.wait = units, gatherer, waiter
        self.module_needs = list(hooked.needs)
        self.records: List[int] = []  # the micro-batches begun this step (the engine's abort counts them)
        self.stats: dict = {}         # no fetch counters: a publish is one gather per unit, every step
        self.active = False           # in a micro-batch or an inference call: forwards wait for their units
        self._publishing = 0          # units whose publish gather was not waited for yet
        self._hooks = ModuleHooks(hooked, self.enter)
        self.access = ParameterAccess(params, {n: units.layout.slots[n].unit for n in params}, self.on_access)

    # --- the publish ------------------------------------------------------------------------

    def publish(self) -> None:
        """After the optimizer step: start gathering every unit from the updated shard."""
        self.access.install()
        self._publishing = len(self.units)
        for group_units in self.gatherer.coalesce([u.index for u in self.units]):
            handle = self.gatherer.gather(group_units, [self.units[u].full for u in group_units],
                                          channel=Channel.GATHER)
            for u in group_units:
                self.units[u].start_gather(handle)

    def flush(self) -> None:
        """Finish every gather in flight; see [Note: deferred publish]."""
        self._wait_all()
        self.gatherer.release_idle()

    def _wait_all(self) -> None:
        for u in self.units.holding():
            self._wait_resident(u)

    def _wait_resident(self, unit: int) -> None:
        """Wait for ``unit``'s gather; once the last publish gather is done, stop seeing reads
        ([Note: reads during a publish])."""
        finished = self.units.wait(unit, self.wait)
        if finished and self._publishing:
            self._publishing = max(self._publishing - finished, 0)
            if not self._publishing:
                self.access.suspend()

    # --- events -------------------------------------------------------------------------------

    def enter(self, index: int) -> None:
        """A hooked module is about to run: wait for its units' gathers."""
        if self.active:
            for u in self.module_needs[index]:
                self._wait_resident(u)
            self.gatherer.release_idle()  # the publish's staging, once its last gather is waited for

    def on_access(self, name: str, unit: int) -> None:
        """A parameter of ``unit`` is about to be read while a publish is in flight; see
        [Note: parameter access]."""
        if self.units[unit].state is UnitState.GATHERING:
            self._wait_resident(unit)

    def enter_module(self, module: torch.nn.Module) -> bool:
        """Recomputation under activation checkpointing needs nothing: the forward waited for
        every unit the module needs, and none is freed."""
        return False

    def exit_module(self, module: torch.nn.Module) -> None:
        pass

    def on_grads_done(self, unit: int) -> None:
        """Nothing to free: the units are resident."""

    def pack(self, t: torch.Tensor):
        return t

    def unpack(self, obj):
        return obj

    # --- step lifecycle (called by the engine) ------------------------------------------------

    def begin_step(self) -> None:
        self.records = []

    def begin_micro_batch(self, micro_batch: int) -> None:
        self.records.append(micro_batch)
        self.active = True

    def begin_backward(self) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    def abort_micro_batch(self) -> None:
        """Nothing to take part in: the publish gathers were all issued at the last step's end."""

    def end_micro_batch(self) -> None:
        """After the micro-batch's reductions: every publish gather finished."""
        self._wait_all()

    def status(self) -> Tuple[float, float, float]:
        """(left the plan, events, digest) for the step's status all-reduce: no plan, no trace."""
        return 0.0, 0.0, 0.0

    def end_step(self, failed: bool, any_exit: bool, agreed: bool) -> None:
        self.active = False

    def begin_inference(self) -> None:
        """Before ``evaluate``/``run`` computes: forwards wait for the published gathers where
        needed ([Note: inference calls] in engine/inference.py)."""
        self.records = [0]
        self.active = True

    def end_inference(self) -> None:
        """After ``evaluate``/``run`` computed (or raised): every publish gather finished."""
        try:
            self._wait_all()
        finally:
            self.active = False
            self.records = []

    def remove(self) -> None:
        """Unhook the modules and give the parameters their plain class back."""
        self._hooks.remove()
        self.access.remove()
