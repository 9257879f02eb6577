"""The ZeRO-3 coordinator: fetch parameters just before use, prefetch along a recorded trace.

[Note: fetch trace]
A step is a sequence of *events*: a module about to run forward (it needs its units), and,
in backward, a unit whose saved parameter views autograd is about to read. During the
first step the coordinator records that sequence; at the end of the step every rank
checks it recorded the same sequence (a mismatch is an error naming the first differing
module: the ranks would otherwise issue different collectives). From then on, when event
``i`` happens the coordinator starts the all-gathers of the units of events ``i+1, ...``
without waiting, up to ``prefetch_bytes`` ahead and ``max_live_bytes`` gathered in all.
After a module ran, a unit needed again within ``reuse_distance`` events stays gathered,
and so does one whose next use lies inside the prefetch window (``prefetch_bytes`` of
upcoming events' parameters): the prefetcher would gather it again right away, so freeing
it would only repeat the all-gather. This is what keeps the last modules of forward
gathered into backward (FSDP keeps its root for the same reason), and a model that fits in
the window is gathered once per step instead of twice; the gathered bytes stay bounded by
the window, as they were already while prefetching.
In backward a unit is freed once all of its parameters' gradients have been handed to the
reducer. If a step departs from the trace (a data-dependent branch), prefetching stops for
the rest of that step, every fetch is on demand (still correct), the new order is recorded,
verified and used from the next step on; this is logged once.

Backward needs no module hooks: saved-tensor hooks tag the tensors autograd saves that live
in a unit's full buffer, and unpacking one fetches that unit (see [Note: storage resize]).

Every decision depends only on the trace and the unit states, never on timing, so every
rank issues the same collectives in the same order ([Note: collective order]).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zeroray.comm.gather import GatherHandle, UnitGatherer
from zeroray.comm.group import Group
from zeroray.params import UnitBuffers, UnitState

log = logging.getLogger("zeroray")

Event = Tuple[str, int]  # ("F", module index) or ("B", unit index)


class TraceMismatchError(RuntimeError):
    pass


class FetchCoordinator:
    def __init__(self, buffers: UnitBuffers, gatherer: UnitGatherer, group: Group,
                 modules: Sequence[torch.nn.Module], module_names: Sequence[str],
                 module_units: Sequence[Tuple[int, ...]], *, prefetch: bool, prefetch_bytes: int,
                 max_live_bytes: int, reuse_distance: int) -> None:
        self.buffers, self.gatherer, self.group = buffers, gatherer, group
        self.modules, self.module_names, self.module_units = list(modules), list(module_names), list(module_units)
        self.prefetch_enabled, self.prefetch_bytes = prefetch, prefetch_bytes
        self.max_live_bytes, self.reuse_distance = max_live_bytes, reuse_distance
        self.layout = buffers.layout
        self._index_of = {id(m): i for i, m in enumerate(self.modules)}
        self.trace: Optional[List[Event]] = None
        self._handles: Dict[int, GatherHandle] = {}
        self._active = [0] * len(self.layout.units)   # modules currently running that use a unit
        self._ptr_to_unit: Dict[int, int] = {}
        self._hooks = []
        self._logged_deviation = False
        self.backward = False
        self._reset_step_stats()
        for u in range(len(self.layout.units)):
            self.buffers.free(u)
        for index, module in enumerate(self.modules):
            self._hooks.append(module.register_forward_pre_hook(self._make_pre_hook(index)))
            self._hooks.append(module.register_forward_hook(self._make_post_hook(index)))

    # --- per step --------------------------------------------------------------------------

    def _reset_step_stats(self) -> None:
        self.stats = {"fetches": 0, "prefetch_hits": 0, "on_demand": 0, "peak_gathered_bytes": 0,
                      "fetch_wait_s": 0.0}

    def begin_step(self) -> None:
        self._reset_step_stats()
        self._begin_pass()

    def _begin_pass(self) -> None:
        """Start of one micro-batch's forward."""
        self.recording: List[Event] = []
        self.following = self.trace is not None
        self.pos = 0
        self.backward = False

    def begin_backward(self) -> None:
        self.backward = True

    def end_micro_batch(self, last: bool) -> None:
        """After one micro-batch's backward: free everything, check and adopt the trace."""
        self._drain()
        for u, state in enumerate(self.buffers.state):
            if state is not UnitState.SHARDED:
                self._free(u)
        if self.trace is None or not self.following or self.pos != len(self.trace):
            self._adopt(self.recording)
        if not last:
            self._begin_pass()

    def _adopt(self, events: List[Event]) -> None:
        self._verify_same_on_all_ranks(events)
        if self.trace is not None and not self._logged_deviation:
            log.info("zeroray: module order changed (data-dependent branch?); fetched on demand for one "
                     "step and re-recorded the prefetch trace")
            self._logged_deviation = True
        self.trace = list(events)
        self._next_use = self._compute_next_use(self.trace)
        # _cum_bytes[i]: parameter bytes of events 0..i-1 (a unit counted at each use), the
        # prefetcher's measure of distance along the trace
        self._cum_bytes = [0]
        for event in self.trace:
            self._cum_bytes.append(self._cum_bytes[-1] + sum(self.buffers.unit_bytes(u) for u in self._event_units(event)))

    def _compute_next_use(self, trace: List[Event]) -> List[Dict[int, int]]:
        """For each event index, unit -> index of that unit's next use after it."""
        out: List[Dict[int, int]] = [dict() for _ in trace]
        last: Dict[int, int] = {}
        for i in range(len(trace) - 1, -1, -1):
            out[i] = dict(last)
            for u in self._event_units(trace[i]):
                last[u] = i
        return out

    def _event_units(self, event: Event) -> Tuple[int, ...]:
        kind, index = event
        return self.module_units[index] if kind == "F" else (index,)

    # --- events ----------------------------------------------------------------------------

    def _event(self, event: Event) -> None:
        self.recording.append(event)
        if self.following:
            if self.pos < len(self.trace) and self.trace[self.pos] == event:
                self.pos += 1
            else:
                self.following = False

    def _make_pre_hook(self, index: int):
        def hook(module, args):
            self._event(("F", index))
            for u in self.module_units[index]:
                self._active[u] += 1
            self.ensure(self.module_units[index])
            self._prefetch()
        return hook

    def _make_post_hook(self, index: int):
        def hook(module, args, output):
            for u in self.module_units[index]:
                self._active[u] -= 1
                if not self.backward and self._active[u] == 0 and not self._needed_soon(u):
                    self._free(u)
        return hook

    def _needed_soon(self, unit: int) -> bool:
        """Keep ``unit`` gathered: its next use is within reuse_distance events or the prefetch window."""
        if not self.following or self.pos == 0:
            return False
        nxt = self._next_use[self.pos - 1].get(unit)
        if nxt is None:
            return False
        if nxt - (self.pos - 1) <= self.reuse_distance:
            return True
        ahead = self._cum_bytes[nxt] - self._cum_bytes[self.pos] + self.buffers.unit_bytes(unit)
        return (self.prefetch_enabled and ahead <= self.prefetch_bytes
                and self.buffers.gathered_bytes() <= self.max_live_bytes)

    def ensure_module(self, module: torch.nn.Module) -> None:
        """Gather a module's units outside its hooks (recomputation under activation checkpointing)."""
        index = self._index_of.get(id(module))
        if index is not None:
            self.ensure(self.module_units[index])

    def on_backward_use(self, unit: int) -> None:
        """A saved view of ``unit`` is being unpacked by autograd."""
        if not self.recording or self.recording[-1] != ("B", unit):
            self._event(("B", unit))
            self._prefetch()
        self.ensure((unit,))

    def on_grads_done(self, unit: int) -> None:
        """All gradients of ``unit`` were handed to the reducer: its parameters are no longer needed."""
        if self._active[unit] == 0 and self.buffers.state[unit] is not UnitState.SHARDED:
            self._free(unit)

    # --- gathering -------------------------------------------------------------------------

    def ensure(self, units: Sequence[int]) -> None:
        missing = []
        for u in units:
            state = self.buffers.state[u]
            self.stats["fetches"] += 1
            if state is UnitState.SHARDED:
                missing.append(u)
                self.stats["on_demand"] += 1
            else:
                self.stats["prefetch_hits"] += 1
        if missing:
            self._issue(missing)
        t0 = time.perf_counter()
        for u in units:
            self._complete(u)
        self.stats["fetch_wait_s"] += time.perf_counter() - t0

    def _complete(self, unit: int) -> None:
        """Wait for the gather that holds ``unit`` (if any): all of its units become GATHERED."""
        handle = self._handles.pop(unit, None)
        if handle is not None:
            handle.wait()
            for v in handle.units:
                self._handles.pop(v, None)
                self.buffers.state[v] = UnitState.GATHERED

    def _issue(self, units: List[int]) -> None:
        for group_units in self.gatherer.coalesce(units):
            fulls = []
            for u in group_units:
                fulls.append(self.buffers.alloc(u))
                self.buffers.state[u] = UnitState.GATHERING
                self._ptr_to_unit[fulls[-1].untyped_storage().data_ptr()] = u
            handle = self.gatherer.gather(group_units, fulls, async_op=True)
            for u in group_units:
                self._handles[u] = handle
        gathered = self.buffers.gathered_bytes()
        if gathered > self.stats["peak_gathered_bytes"]:
            self.stats["peak_gathered_bytes"] = gathered

    def _prefetch(self) -> None:
        if not (self.prefetch_enabled and self.following and self.trace):
            return
        ahead, budget_used, todo = self.pos, 0, []
        live = self.buffers.gathered_bytes()
        while ahead < len(self.trace):
            for u in self._event_units(self.trace[ahead]):
                if u in todo:
                    continue
                nbytes = self.buffers.unit_bytes(u)
                if self.buffers.state[u] is UnitState.SHARDED:
                    if budget_used + nbytes > self.prefetch_bytes or live + nbytes > self.max_live_bytes:
                        ahead = len(self.trace)
                        break
                    todo.append(u)
                    live += nbytes
                budget_used += nbytes
            ahead += 1
        if todo:
            self._issue(todo)

    def _free(self, unit: int) -> None:
        self._complete(unit)  # never free memory a collective is still writing into
        ptr = self.buffers.full[unit].untyped_storage().data_ptr()
        self._ptr_to_unit.pop(ptr, None)
        self.buffers.free(unit)

    def _drain(self) -> None:
        for u in list(self._handles):
            self._complete(u)

    # --- saved tensors ---------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        try:
            unit = self._ptr_to_unit.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            unit = None
        return t if unit is None else (_UnitRef, unit, t)

    def unpack(self, obj):
        if type(obj) is tuple and len(obj) == 3 and obj[0] is _UnitRef:
            self.on_backward_use(obj[1])
            return obj[2]
        return obj

    # --- trace verification ----------------------------------------------------------------

    def _verify_same_on_all_ranks(self, events: List[Event]) -> None:
        if self.group.world_size == 1:
            return
        codes = [i if k == "F" else -(i + 1) for k, i in events]
        digest = 0
        for c in codes:
            digest = (digest * 1000003 + c + 7) % (2**61 - 1)
        probe = torch.tensor([len(codes), digest, -len(codes), -digest], dtype=torch.float64)
        self.group.all_reduce(probe, op="max")
        if probe[0] == -probe[2] and probe[1] == -probe[3]:
            return
        n = int(probe[0].item())
        mine = torch.full((n,), -(10**9), dtype=torch.int64)
        mine[:len(codes)] = torch.tensor(codes, dtype=torch.int64)
        everyone = torch.empty(n * self.group.world_size, dtype=torch.int64)
        self.group.all_gather(everyone, mine)
        rows = everyone.view(self.group.world_size, n)
        for i in range(n):
            column = rows[:, i].tolist()
            if len(set(column)) > 1:
                names = [self._describe(c) for c in column]
                raise TraceMismatchError(
                    f"stage 3 needs every worker to run the same modules in the same order, but at event {i} "
                    f"of the step the workers ran: " + ", ".join(f"rank {r}: {n_}" for r, n_ in enumerate(names))
                    + ". Make control flow in forward independent of the worker's batch (or use stage 0-2).")

    def _describe(self, code: int) -> str:
        if code == -(10**9):
            return "<nothing>"
        if code >= 0:
            return f"module {self.module_names[code] or '<root>'!r}"
        return f"backward of unit {self.layout.units[-code - 1].module!r}"

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _UnitRef:
    """Tag of a saved tensor that lives in a unit's full buffer."""
