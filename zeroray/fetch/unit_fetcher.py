"""Stage 3's coordinator, ``UnitFetcher``: when each unit is gathered, waited for and freed.

It decides *when*; the units (fetch/unit.py) own the buffers, the gatherer (comm/gather.py) moves
the bytes, the trace and schedule (fetch/trace.py) are pure. Events reach it from module hooks
(a unit root about to run, or done), from parameter reads ([Note: parameter access] in
fetch/access.py; the access class stays installed from construction to ``remove``), and, as its
``UnitEvents`` (fetch/lifecycle.py), from autograd unpacking a saved view of a unit in backward,
from a checkpointed module's recomputation and from a unit's last gradient.

Its state is two things. The ``Phase`` of the step (fetch/lifecycle.py), as at every stage:
where the micro-batch is (forward, backward, computed) or that none is open (IDLE). And, while
a micro-batch is open, its ``FetchMode``: whether it follows the trace's schedule or negotiates.
The two are apart because a micro-batch may leave the plan in any phase of it.

A step follows the schedule of a verified trace ([Note: fetch trace] in fetch/trace.py), or, without
one, negotiates every fetch ([Note: negotiated fetch] in fetch/negotiate.py). Stages 1-2 have a
coordinator of their own, which only publishes the optimizer's update (fetch/publish.py).

[Note: plan exit]
A rank whose events leave the trace (a branch the others may not take, an error in its
``loss_fn``) cannot fetch off the plan: its peers are issuing the plan's gathers. So it
*leaves the plan*: it publishes ``exit/<call>/<micro-batch>`` through the group's store,
issues every gather of the micro-batch's plan it has not issued yet (taking part, keeping
nothing: its peers need its shards), and negotiates from then on. Every other rank learns
of the exit the next time it waits for something the leaver owes it (the waiter polls,
comm/waiter.py), leaves the plan the same way, and answers rounds until all are done.
Because every rank issues the whole plan exactly once, and rounds have a channel of their
own, the collectives still match; the step trains exactly, and its status all-reduce tells
every rank whether the ranks agreed (the new trace is adopted) or diverged (the old one is
kept, and such steps negotiate again). Without independent channels (NCCL) a rank cannot
leave the plan safely: it publishes the exit and raises ``UnrecoverableDivergence``; the
others see the exit while they wait (``poll``) and raise too.

[Note: answering rounds outside zeroray]
The waiter's poll answers a peer only while this rank waits inside zeroray. The user's code
may block elsewhere: a collective of its own on torch.distributed's default group (a metric's
``dist.all_reduce`` in ``loss_fn``, a SyncBatchNorm in the model: [Note: torch.distributed in
user code] in comm/user_group.py). When the ranks run different modules (a negotiated
micro-batch, or one a peer left the plan in), a rank that has one more unit to fetch waits in
a round for a peer that already sits in that collective, and the peer waits there for it:
both block until the collective timeout. zeroray cannot see such a call (it is torch's, on
torch's own group), so it answers for the rank instead: while a micro-batch's forward or
backward is open on several ranks over independent channels, a helper thread (``_Answerer``)
calls ``poll`` every ``interval_s`` whenever the compute thread is outside the coordinator.
A lock makes the two exclusive: every entry into the coordinator (hooks, parameter reads,
saved tensors, the lifecycle, ``poll`` itself) takes it, and the helper only tries it, so it
acts exactly where the compute thread could have been waiting, in user code, with the same
effect as a poll there. It only ever joins rounds (needing nothing), finishes an earlier
micro-batch's rounds, and leaves the plan (dry gathers), none of which changes a unit this
rank's code reads. An error in it (a peer died) is raised by the compute thread's next
entry. Over NCCL there are no rounds to answer, and a single rank has no peer.
"""
from __future__ import annotations

import enum
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zeroray.comm.gather import GatherHandle, UnitGatherer
from zeroray.comm.group import Channel, Group
from zeroray.comm.waiter import Waiter
from zeroray.errors import ParameterAccessError, UnrecoverableDivergence
from zeroray.fetch.access import ParameterAccess
from zeroray.fetch.hooks import HookedModules, ModuleHooks
from zeroray.fetch.lifecycle import Coordinator, Phase
from zeroray.fetch.negotiate import Negotiator
from zeroray.fetch.trace import Event, EventKind, Holds, Schedule, digest, event_needs
from zeroray.fetch.unit import Units, UnitState

log = logging.getLogger("zeroray")


class FetchMode(enum.Enum):
    """How the open micro-batch (or inference call) fetches; read only while the ``Phase`` is not IDLE.

    FOLLOW: on a verified trace's schedule: its gathers, prefetch and frees ([Note: fetch trace]
        in fetch/trace.py).
    NEGOTIATE: without one: every fetch agreed in rounds ([Note: negotiated fetch] in
        fetch/negotiate.py). A micro-batch begins here when there is no trace (and an inference
        call always does), or moves here from FOLLOW when it leaves the plan ([Note: plan exit]);
        never back.
    """

    FOLLOW = "follow"
    NEGOTIATE = "negotiate"


@dataclass
class MicroBatchRecord:
    events: List[Event] = field(default_factory=list)
    exited: bool = False       # this rank left the plan (or negotiated throughout)
    finished: bool = False     # its done-rounds completed


def _divergence(who: str, why: str) -> UnrecoverableDivergence:
    """Leaving the plan where the collectives share one order (NCCL): see [Note: plan exit]."""
    return UnrecoverableDivergence(
        f"stage 3: {who} left the step's prefetch plan ({why}); over NCCL the workers cannot negotiate "
        "fetches in the middle of a step. Make forward's control flow the same on every worker, or use stage 0-2.")


def _exclusive(method: Callable) -> Callable:
    """An entry into the coordinator: holds its lock against the helper thread that answers
    rounds for user code (see [Note: answering rounds outside zeroray])."""

    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        with self._lock:
            error, self._answer_error = self._answer_error, None
            if error is not None:
                raise error
            return method(self, *args, **kwargs)
    return entry


class _Answerer:
    """The helper thread of [Note: answering rounds outside zeroray]. It holds the fetcher only
    weakly, and stops when the fetcher is removed or collected."""

    def __init__(self, fetcher: "UnitFetcher", interval_s: float) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(weakref.ref(fetcher), interval_s),
                                       name="zeroray-stage3-answerer", daemon=True)
        self.thread.start()

    def _run(self, ref: "weakref.ref[UnitFetcher]", interval_s: float) -> None:
        while not self.stop.wait(interval_s):
            fetcher = ref()
            if fetcher is None:
                return
            fetcher.answer_for_user_code()
            del fetcher

    def close(self) -> None:
        """Stop after the poll in progress, if any, without waiting for it: a round it is in may
        only end at the collective timeout where the group broke (the fetcher is being
        discarded then)."""
        self.stop.set()


class UnitFetcher(Coordinator):
    """Hooks, events and the stage-3 fetch protocol of one engine; see the module docstring.

    ``hooked``: the modules whose forward needs units; ``params``: the trainable parameters
    (name -> parameter) whose reads it sees. ``on_negotiate``: called when a micro-batch starts
    negotiating (the engine adapts its reductions); ``before_done_rounds``: called when this rank
    computed its micro-batch, before it says it is done (``_launch_before_done`` says why)."""

    def __init__(self, units: Units, gatherer: UnitGatherer, group: Group, waiter: Waiter,
                 hooked: HookedModules, params: Dict[str, torch.nn.Parameter], *, prefetch: bool,
                 prefetch_bytes: Optional[int], max_live_bytes: Optional[int], reuse_distance: int,
                 on_negotiate: Callable[[], None] = lambda: None,
                 before_done_rounds: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.units, self.gatherer, self.group, self.wait = units, gatherer, group, waiter
        self.module_names, self.module_needs = list(hooked.names), list(hooked.needs)
        # None: sized from the model (see ZeroConfig): the largest unit, at least one bucket; no other bound
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes if prefetch_bytes is not None else \
            max(max(u.nbytes for u in units), gatherer.bucket_bytes)
        self.max_live_bytes = max_live_bytes if max_live_bytes is not None else sum(u.nbytes for u in units)
        self.reuse_distance = reuse_distance
        self.layout = units.layout
        self.on_negotiate, self.before_done_rounds = on_negotiate, before_done_rounds
        self.negotiator = Negotiator(group, gatherer, units, waiter)
        self.schedule: Optional[Schedule] = None
        self.mode = FetchMode.NEGOTIATE  # set as each micro-batch begins
        self.call = 0                 # train_step calls so far: names this step's signals
        self.records: List[MicroBatchRecord] = []
        self._holds = Holds()
        self._pos = 0                 # schedule position (FOLLOW)
        self._issued = 0              # schedule groups issued (FOLLOW)
        self._dry: List[GatherHandle] = []
        self._logged: set = set()
        self._reset_stats()
        self._hooks = ModuleHooks(hooked, self.enter, self.exit)
        self.access = ParameterAccess(params, {n: self.layout.slots[n].unit for n in params}, self.on_access)
        self._lock = threading.RLock()  # every entry: [Note: answering rounds outside zeroray]
        self._answer_error: Optional[BaseException] = None
        self._answerer = _Answerer(self, waiter.interval_s) \
            if group.world_size > 1 and group.independent_channels and waiter.blocking_waits else None
        self.access.install()  # before any user callback may read a parameter
        waiter.poll = self.poll

    # --- step lifecycle (called by the engine) --------------------------------------------

    def _reset_stats(self) -> None:
        self.stats = {"fetches": 0, "prefetch_hits": 0, "on_demand": 0, "peak_gathered_bytes": 0,
                      "fetch_wait_s": 0.0, "rounds": 0, "plan_exits": 0}

    @_exclusive
    def begin_step(self) -> None:
        super().begin_step()
        self.call += 1
        self.records = []
        self._reset_stats()
        self.negotiator.rounds = 0

    def _begin(self, record: MicroBatchRecord) -> None:
        self.records.append(record)
        self._holds = Holds()
        self._pos = self._issued = 0

    @_exclusive
    def begin_micro_batch(self, micro_batch: int) -> None:
        super().begin_micro_batch(micro_batch)
        self._begin(MicroBatchRecord())
        if self.schedule is not None:
            self.mode = FetchMode.FOLLOW
            self._read_ahead()
        else:
            self.mode = FetchMode.NEGOTIATE
            self.records[-1].exited = True
            self.on_negotiate()

    @_exclusive
    def begin_backward(self) -> None:
        super().begin_backward()
        self._event(EventKind.BACKWARD_START, 0)

    @_exclusive
    def finish_backward(self) -> None:
        """Before the micro-batch's reductions are waited for: complete the fetch protocol."""
        self._launch_before_done()
        super().finish_backward()
        if self.mode is FetchMode.FOLLOW and self._pos != len(self.schedule):
            # A prefix of the trace: nothing more to fetch, only the rest of the plan to take part in.
            self.records[-1].exited = True
            self._issue_rest_dry()
        if self.mode is FetchMode.NEGOTIATE:
            self._finish_rounds(self.micro_batch)

    @_exclusive
    def abort_micro_batch(self, micro_batch: int) -> None:
        """This rank stops computing ``micro_batch`` (its code raised, in it or before it began):
        take part in every gather its peers still expect of it, and in their rounds."""
        if not self._began(micro_batch):
            self.begin_micro_batch(micro_batch)
        self._launch_before_done()
        super().abort_micro_batch(micro_batch)
        if self.mode is FetchMode.FOLLOW:
            self._issue_rest_dry()
        elif self.mode is FetchMode.NEGOTIATE:
            self._finish_rounds(self.micro_batch)

    def _launch_before_done(self) -> None:
        """This rank computed its micro-batch: the engine launches the reductions its backward
        left short of gradients (``before_done_rounds``) before this rank says it is done, while
        a wait still only answers its peers' rounds (``poll``). A peer may be blocked in its
        backward on one of them (a bucket holding a gradient only that peer produced: a module
        only it ran, with small buckets) and can only be done once it is launched. They were
        launched after the rounds that end the micro-batch, which wait for every rank to be
        done: a deadlock (found by the issue-24 fuzzer; tests/dist/test_negotiated_small_buckets.py)."""
        self.before_done_rounds()

    @_exclusive
    def end_micro_batch(self) -> None:
        """After the micro-batch's reductions: every gather finished, every unit freed."""
        super().end_micro_batch()
        self._release()

    def _release(self) -> None:
        for handle in self._dry:
            self.wait(handle)
        self._dry.clear()
        for u in self.units.holding():
            self.units.free(u, self.wait)
        self.gatherer.release_discard()
        self._holds = Holds()

    @_exclusive
    def status(self) -> Tuple[float, float, float]:
        """(left the plan, events, digest) of the last micro-batch, for the step's status all-reduce."""
        record = self.records[-1] if self.records else MicroBatchRecord()
        return float(any(r.exited for r in self.records)), float(len(record.events)), float(digest(record.events))

    @_exclusive
    def end_step(self, failed: bool, any_exit: bool, agreed: bool) -> None:
        """After the status all-reduce: adopt the recorded sequence when every rank recorded the same."""
        super().end_step(failed, any_exit, agreed)
        if not failed and any_exit:
            events = self.records[-1].events
            if agreed and (self.schedule is None or events != self.schedule.events):
                if self.schedule is not None:
                    self._log_once("retrace", "zeroray: the modules' order changed (a data-dependent branch, the "
                                              "same on every worker); stage 3 re-recorded its prefetch trace")
                self.schedule = Schedule.build(
                    events, self.module_needs, [u.nbytes for u in self.units], self.gatherer.coalesce,
                    prefetch=self.prefetch, prefetch_bytes=self.prefetch_bytes,
                    max_live_bytes=self.max_live_bytes, reuse_distance=self.reuse_distance)
            elif not agreed:
                self._log_once("diverged", "zeroray: the workers ran different modules in one step (data-dependent "
                                           "control flow); stage 3 negotiated each fetch in that step, which trains "
                                           "exactly but without prefetch (see comm_report()['rounds'])")
        if self.group.rank == 0 and any_exit:  # no exit, no signal to clear (and no round trips)
            for m in range(len(self.records)):
                self.group.clear_signal(self._exit_key(m))
        self.negotiator.forget(self.call)
        self.stats["rounds"] = self.negotiator.rounds

    # --- an inference call (called by the engine): see [Note: inference calls] in engine/inference.py --

    @_exclusive
    def begin_inference(self) -> None:
        """Before ``evaluate``/``run`` computes: negotiate every fetch under a call id of its own,
        so its rounds never meet a step's. Nothing it records becomes a trace, and
        ``on_negotiate`` is not called: an inference call reduces nothing."""
        super().begin_inference()
        self.call += 1
        self.records = []
        self._begin(MicroBatchRecord(exited=True))
        self.mode = FetchMode.NEGOTIATE

    @_exclusive
    def end_inference(self) -> None:
        """After ``evaluate``/``run`` computed (or raised): answer rounds until every rank is done,
        then free every unit; the rounds' signals are cleared and the coordinator is IDLE again.
        The schedule is untouched."""
        try:
            if self.phase is Phase.FORWARD:  # (IDLE: the group broke during the call)
                self._move("finish_inference")
                self._finish_rounds(0)
            self._release()
            self.negotiator.forget(self.call)
            self.stats["rounds"] = self.negotiator.rounds
        finally:
            super().end_inference()
            self.records = []

    @_exclusive
    def flush(self) -> None:
        """Finish every gather still in flight (none between steps, where every unit is freed)."""
        for u in self.units.holding():
            self.units.wait(u, self.wait)

    # --- events ----------------------------------------------------------------------------

    @_exclusive
    def enter(self, index: int) -> None:
        if self.phase is not Phase.IDLE:
            self._event(EventKind.FORWARD, index)

    @_exclusive
    def exit(self, index: int) -> None:
        if self.phase is not Phase.IDLE:
            self._event(EventKind.END, index)

    @_exclusive
    def enter_module(self, module: torch.nn.Module) -> bool:
        """Recomputation under activation checkpointing: the checkpointed module's own hooks do
        not fire, so its units are fetched here (an event like its pre-hook); True if hooked."""
        index = self._hooks.index(module)
        if index is None or self.phase is not Phase.BACKWARD:
            return False
        self.enter(index)
        return True

    @_exclusive
    def exit_module(self, module: torch.nn.Module) -> None:
        self.exit(self._hooks.index(module))

    @_exclusive
    def on_access(self, name: str, unit: int) -> None:
        """A parameter of ``unit`` is about to be read; see [Note: parameter access]."""
        state = self.units[unit].state
        if self.phase is Phase.IDLE:
            if state is UnitState.GATHERING:
                self.units.wait(unit, self.wait)
            elif state is UnitState.SHARDED:
                module = self.layout.units[unit].module or "<root>"
                raise ParameterAccessError(
                    f"parameter {name!r} (unit of module {module!r}) was read outside a training step, where "
                    "stage 3 keeps only this worker's shard of it. Read parameters in loss_fn or in the model's "
                    "forward (zeroray gathers them there), and on the driver use trainer.get_parameter(name) or "
                    "trainer.state_dict().")
            return
        expected = self.mode is FetchMode.FOLLOW and self._pos < len(self.schedule) and \
            self.schedule.events[self._pos] == (EventKind.ACCESS, unit)
        if state is UnitState.SHARDED or expected:
            self._event(EventKind.ACCESS, unit)
        elif state is UnitState.GATHERING:
            self.units.wait(unit, self.wait)

    @_exclusive
    def on_backward_use(self, unit: int) -> None:
        """A saved view of ``unit`` is being unpacked by autograd."""
        events = self.records[-1].events if self.records else []
        if not events or events[-1] != (EventKind.BACKWARD, unit):
            self._event(EventKind.BACKWARD, unit)
        else:  # the same unit again, right after: already fetched for the previous unpack
            self.stats["fetches"] += 1
            self.stats["prefetch_hits"] += 1
            self.units.wait(unit, self.wait)

    @_exclusive
    def on_grads_done(self, unit: int) -> None:
        """All gradients of ``unit`` reached the reducer: its parameters are no longer needed."""
        if self.phase is not Phase.IDLE and self._holds.count(unit) == 0:
            self.units.free(unit, self.wait)

    def _event(self, kind: EventKind, index: int) -> None:
        assert self.phase is not Phase.IDLE, f"a {kind.name} event with no micro-batch open"
        self.records[-1].events.append((kind, index))
        needs = event_needs((kind, index), self.module_needs)
        released = self._holds.add((kind, index), needs)
        if self.mode is FetchMode.FOLLOW:
            if self._pos < len(self.schedule) and self.schedule.events[self._pos] == (kind, index):
                if self._follow():
                    return
            else:
                self._leave_plan(f"event {len(self.records[-1].events) - 1} ({self._describe((kind, index))}) "
                                 "differs from the trace")
        # NEGOTIATE
        for u in released:
            self.units.free(u, self.wait)
        self._fetch(needs)

    # --- following the schedule ------------------------------------------------------------

    def _follow(self) -> bool:
        """Do schedule position ``_pos``; False if the plan turned out not to hold (left it)."""
        position = self.schedule.positions[self._pos]
        self._pos += 1
        for group_units in position.on_demand:
            self._issue(group_units)
        t0 = time.perf_counter()
        on_demand = {x for g in position.on_demand for x in g} if position.on_demand else ()
        for u in position.needs:
            state = self.units[u].state
            self.stats["fetches"] += 1
            if state is UnitState.SHARDED:
                self._leave_plan(f"unit {self.layout.units[u].module!r} was not gathered where the trace needs it")
                return False
            self.stats["prefetch_hits" if u not in on_demand else "on_demand"] += 1
            self.units.wait(u, self.wait)
        self.stats["fetch_wait_s"] += time.perf_counter() - t0
        for group_units in position.prefetch:
            self._issue(group_units)
        for u in position.release:
            self.units.free(u, self.wait)
        if position.on_demand or position.prefetch:
            # Only a gather allocates: between the positions that issue one the gathered bytes only
            # fall, so measuring here alone gives the same peak without a walk over every unit at
            # every event.
            self._peak()
        return True

    def _issue(self, group_units: Tuple[int, ...], wet: bool = True) -> None:
        self._issued += 1
        self._read_ahead()
        if not wet:
            self._dry.append(self.gatherer.gather(list(group_units), [None] * len(group_units),
                                                  channel=Channel.GATHER))
            return
        fulls = [self.units.alloc(u) for u in group_units]
        handle = self.gatherer.gather(list(group_units), fulls, channel=Channel.GATHER)
        for u in group_units:
            self.units[u].start_gather(handle)

    def _read_ahead(self) -> None:
        """Let the gatherer's shard start reading the slices of the plan's next gathers, those
        after the ones issued (``_issued``) up to ``prefetch_bytes`` of units (at least one
        gather): the same window as the gathers' own prefetch, one window further along the
        trace. A shard in memory ignores it; one on disk reads them on its thread pool, so that
        a gather finds its slice in memory ([Note: parameter shard on disk] in offload/shard.py)."""
        if not self.gatherer.reads_ahead:
            return  # the shard is in memory: no walk over the plan at every gather
        window = 0
        for k in range(self._issued, len(self.schedule.groups)):
            group_units = self.schedule.groups[k]
            window += sum(self.units[u].nbytes for u in group_units)
            if k > self._issued and window > self.prefetch_bytes:
                break
            self.gatherer.read_ahead(group_units)

    def _peak(self) -> None:
        gathered = self.units.gathered_bytes()
        if gathered > self.stats["peak_gathered_bytes"]:
            self.stats["peak_gathered_bytes"] = gathered

    # --- leaving the plan, negotiating -----------------------------------------------------

    def _exit_key(self, micro_batch: int) -> str:
        return f"exit/{self.call}/{micro_batch}"

    def _issue_rest_dry(self) -> None:
        """Take part in the plan's remaining gathers, keeping nothing (the peers need this rank's shards)."""
        for group_units in self.schedule.groups[self._issued:]:
            self._issue(group_units, wet=False)

    def _leave_plan(self, why: str) -> None:
        """Fetch off the plan from now on; see [Note: plan exit]."""
        if self.mode is not FetchMode.FOLLOW:
            return
        self.stats["plan_exits"] += 1
        self.records[-1].exited = True
        if self.group.signalled(self._exit_key(self.micro_batch)) is None:
            self.group.signal(self._exit_key(self.micro_batch), f"rank {self.group.rank}: {why}")
        if not self.group.independent_channels:
            self._abandon()
            raise _divergence(f"worker {self.group.rank}", why)
        self._issue_rest_dry()
        self.mode = FetchMode.NEGOTIATE
        self.on_negotiate()

    def _fetch(self, needs: Sequence[int]) -> None:
        """NEGOTIATE: wait for what is in flight, agree on and gather what is missing."""
        if not needs:
            return
        self._join_earlier()
        t0 = time.perf_counter()
        missing = []
        for u in needs:
            self.stats["fetches"] += 1
            state = self.units[u].state
            if state is UnitState.SHARDED:
                missing.append(u)
                self.stats["on_demand"] += 1
            else:
                self.stats["prefetch_hits"] += 1
        if missing:
            self.negotiator.fetch(self.call, self.micro_batch, missing)
        for u in needs:
            self.units.wait(u, self.wait)
        self.stats["fetch_wait_s"] += time.perf_counter() - t0
        self._peak()

    def _finish_rounds(self, micro_batch: int) -> None:
        record = self.records[micro_batch]
        if not record.finished:
            record.finished = True
            if self.mode is FetchMode.NEGOTIATE and micro_batch == self.micro_batch:
                self._join_earlier()
            self.negotiator.finish(self.call, micro_batch)

    def _join_earlier(self) -> None:
        for m in range(self.micro_batch):
            record = self.records[m]
            if not record.finished and self.group.signalled(self._exit_key(m)) is not None:
                record.exited = True
                self._finish_rounds(m)

    @_exclusive
    def poll(self) -> None:
        """Called between slices of a blocking wait: join any plan exit a peer announced."""
        if self.phase is Phase.IDLE or not self.records:
            return
        if not self.group.independent_channels:
            for m in range(len(self.records)):
                exit_note = self.group.signalled(self._exit_key(m))
                if exit_note is not None:
                    self._abandon()
                    raise _divergence("a peer", exit_note)
            return
        if self.negotiator.in_round:
            return  # a round's own waits: its peers are in it too
        self._join_earlier()
        if self.mode is FetchMode.FOLLOW and self.group.signalled(self._exit_key(self.micro_batch)) is not None:
            self._leave_plan("a peer left the plan")
        if self.mode is FetchMode.NEGOTIATE:
            if self.phase is Phase.COMPUTED:
                self._finish_rounds(self.micro_batch)
            else:
                self.negotiator.join(self.call, self.micro_batch)

    def answer_for_user_code(self) -> None:
        """On the helper thread: ``poll`` for the compute thread while it is in user code, in a
        micro-batch's forward or backward; see [Note: answering rounds outside zeroray]."""
        if self.phase not in (Phase.FORWARD, Phase.BACKWARD) or not self._lock.acquire(blocking=False):
            return
        try:
            if self.phase in (Phase.FORWARD, Phase.BACKWARD) and self._answer_error is None:
                self.poll()
        except BaseException as e:  # raised by the compute thread's next entry
            self._answer_error = e
        finally:
            self._lock.release()

    # --- saved tensors (its UnitEvents, with on_grads_done and enter_module/exit_module) ----

    def pack(self, t: torch.Tensor):
        """A saved view of a unit's full buffer is tagged with its unit (the rest as it is)."""
        try:
            unit = self.units.unit_at(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            unit = None
        return t if unit is None else (_UnitRef, unit, t)

    def unpack(self, obj):
        """A tagged view is about to be read: its unit is fetched first (``on_backward_use``)."""
        if type(obj) is tuple and len(obj) == 3 and obj[0] is _UnitRef:
            self.on_backward_use(obj[1])
            return obj[2]
        return obj

    # --- reports and teardown --------------------------------------------------------------

    def _describe(self, event: Event) -> str:
        kind, index = event
        if kind in (EventKind.FORWARD, EventKind.END):
            return f"{'forward' if kind is EventKind.FORWARD else 'end'} of module {self.module_names[index] or '<root>'!r}"
        if kind is EventKind.ACCESS:
            return f"a read of unit {self.layout.units[index].module or '<root>'!r}"
        if kind is EventKind.BACKWARD:
            return f"backward of unit {self.layout.units[index].module or '<root>'!r}"
        return "the start of backward"

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(message)

    def remove(self) -> None:
        """Unhook the modules, stop polling, and give the parameters their plain class back."""
        if self._answerer is not None:
            self._answerer.close()
        self._hooks.remove()
        self.wait.poll = None
        self.access.remove()


class _UnitRef:
    """Tag of a saved tensor that lives in a unit's full buffer."""
