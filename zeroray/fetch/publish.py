"""Stages 1-2's coordinator, ``UpdatePublisher``: publishing the optimizer's update into the resident parameters.

At stages 1-2 every unit's full buffer is a slice of the persistent arena (fetch/unit.py) and is
never freed; after the optimizer step each rank holds the update of its shard only, and the
all-gathers that publish it to every rank are the only fetches there are. This coordinator
starts them (``publish``, called by the storage: engine/storage.py) and waits for each where it
is first needed: in a forward while a micro-batch or an inference call is open (its ``Phase``,
fetch/lifecycle.py, is not IDLE), and at any read. Stage 3 has a coordinator of its own
(fetch/unit_fetcher.py); the engine drives both through the same lifecycle.

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

from typing import Dict

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Channel
from zeroray.comm.waiter import Waiter
from zeroray.fetch.access import ParameterAccess
from zeroray.fetch.hooks import HookedModules, ModuleHooks
from zeroray.fetch.lifecycle import Coordinator, Phase
from zeroray.fetch.unit import Units, UnitState


class UpdatePublisher(Coordinator):
    """Starts the publish gathers and waits for each unit's where it is first needed; see the
    module docstring. ``hooked``: the modules whose forward needs units; ``params``: the
    trainable parameters (name -> parameter) whose reads it sees while a publish is in flight.
    It counts no fetches (``stats`` stays empty): a publish is one gather per unit, every step."""

    def __init__(self, units: Units, gatherer: UnitGatherer, waiter: Waiter, hooked: HookedModules,
                 params: Dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self.units, self.gatherer, self.wait = units, gatherer, waiter
        self.module_needs = list(hooked.needs)
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
        """A hooked module is about to run: in a micro-batch or an inference call, wait for its
        units' gathers (outside one, its reads still wait: ``on_access``)."""
        if self.phase is not Phase.IDLE:
            for u in self.module_needs[index]:
                self._wait_resident(u)
            self.gatherer.release_idle()  # the publish's staging, once its last gather is waited for

    def on_access(self, name: str, unit: int) -> None:
        """A parameter of ``unit`` is about to be read while a publish is in flight; see
        [Note: parameter access]."""
        if self.units[unit].state is UnitState.GATHERING:
            self._wait_resident(unit)

    # --- the lifecycle's calls it acts on (called by the engine; the rest only move the phase) ---
    # Checkpointed recomputation needs nothing: the forward waited for every unit a module
    # needs, and none is freed. An aborted micro-batch takes part in nothing: the publish
    # gathers were all issued at the last step's end.

    def end_micro_batch(self) -> None:
        """After the micro-batch's reductions: every publish gather finished."""
        super().end_micro_batch()
        self._wait_all()

    def end_inference(self) -> None:
        """After ``evaluate``/``run`` computed (or raised): every publish gather finished
        ([Note: inference calls] in engine/inference.py)."""
        try:
            self._wait_all()
        finally:
            super().end_inference()

    def remove(self) -> None:
        """Unhook the modules and give the parameters their plain class back."""
        self._hooks.remove()
        self.access.remove()
