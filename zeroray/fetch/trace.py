"""The stage-3 fetch trace and the schedule derived from it: pure, no tensors, no collectives.

[Note: fetch trace]
One micro-batch is a sequence of *events*:
- ``FORWARD m``: hooked module ``m`` is about to run (it needs its units gathered);
- ``END m``: module ``m`` returned (its units may be freed);
- ``ACCESS u``: a parameter of unit ``u`` was read while ``u`` was not gathered (in
  ``loss_fn``, or in a forward outside the unit's subtree; see [Note: parameter access]);
- ``BACKWARD_START``: the loss's backward begins;
- ``BACKWARD u``: autograd is about to read a saved view of unit ``u``.
Which module an ``ACCESS`` belongs to follows from the events before it: the innermost
``FORWARD`` not yet ``END``ed holds the unit until its ``END`` (none: until the end of the
micro-batch).

The first step records this sequence; once every rank recorded the same one, it becomes
the *trace*, and ``Schedule.build`` turns it, once, into what each position does: which
units to gather on demand, which to wait for, which gathers of upcoming positions to start
(the prefetch window of ``prefetch_bytes``, never more than ``max_live_bytes`` gathered), and
which units to free after an ``END`` (those not needed again within ``reuse_distance``
events or inside the prefetch window: the prefetcher would gather them again at once). The
schedule depends on nothing but the trace and the configuration, so every rank issues the
same gathers in the same order ([Note: collective order] in group.py), and the list of a
micro-batch's gathers is known in advance, which is what lets a rank that leaves it still
issue the rest (see [Note: plan exit] in fetch/unit_fetcher.py). ``Holds`` follows which module
holds which unit, for the schedule and for a step that negotiates alike.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple


class EventKind(enum.Enum):
    FORWARD = "F"
    END = "E"
    ACCESS = "A"
    BACKWARD_START = "S"
    BACKWARD = "B"


Event = Tuple[EventKind, int]  # (kind, module index for FORWARD/END, unit index for ACCESS/BACKWARD, 0 for S)

_KIND_CODE = {EventKind.FORWARD: 0, EventKind.END: 1, EventKind.ACCESS: 2, EventKind.BACKWARD_START: 3,
              EventKind.BACKWARD: 4}
_DIGEST_MOD = (1 << 52) - 1  # exact in a float64, so it can travel in the step's status all-reduce


def digest(events: Sequence[Event]) -> int:
    """A 52-bit fingerprint of an event sequence (equal sequences, equal digests)."""
    h = len(events) % _DIGEST_MOD
    for kind, index in events:
        h = (h * 1000003 + _KIND_CODE[kind] * 7919 + index + 1) % _DIGEST_MOD
    return h


@dataclass(frozen=True)
class Position:
    """What one position of the trace does, in order: ``on_demand`` gathers (groups of units,
    one collective each), wait for ``needs``, ``prefetch`` gathers, then free ``release``."""

    needs: Tuple[int, ...] = ()
    on_demand: Tuple[Tuple[int, ...], ...] = ()
    prefetch: Tuple[Tuple[int, ...], ...] = ()
    release: Tuple[int, ...] = ()


class Schedule:
    """The gathers, waits and frees of one micro-batch that follows ``events``; see [Note: fetch trace]."""

    def __init__(self, events: List[Event], positions: List[Position]) -> None:
        self.events, self.positions = events, positions
        # Every gather of the micro-batch in issue order, and where each position's start.
        self.groups: List[Tuple[int, ...]] = []
        self.first_group: List[int] = []
        for p in positions:
            self.first_group.append(len(self.groups))
            self.groups.extend(p.on_demand + p.prefetch)

    def __len__(self) -> int:
        return len(self.events)

    @classmethod
    def build(cls, events: Sequence[Event], module_needs: Sequence[Tuple[int, ...]], unit_bytes: Sequence[int],
              coalesce: Callable[[List[int]], List[List[int]]], *, prefetch: bool, prefetch_bytes: int,
              max_live_bytes: int, reuse_distance: int) -> "Schedule":
        events = list(events)
        needs = [event_needs(e, module_needs) for e in events]
        n = len(events)
        # uses_before[i]: need-bearing events before position i (reuse_distance counts those)
        uses_before = [0]
        for i in range(n):
            uses_before.append(uses_before[-1] + (1 if needs[i] else 0))
        next_use: List[Dict[int, int]] = [dict() for _ in range(n)]  # after position i: unit -> position
        last: Dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            next_use[i] = dict(last)
            for u in needs[i]:
                last[u] = i
        last_backward_use: Dict[int, int] = {}
        backward_from = next((i for i, e in enumerate(events) if e[0] is EventKind.BACKWARD_START), n)
        for i in range(backward_from, n):
            for u in needs[i]:
                last_backward_use[u] = i

        alive: set = set()
        holds = Holds()
        positions: List[Position] = []

        def live() -> int:
            return sum(unit_bytes[u] for u in alive)

        def needed_soon(u: int, i: int) -> bool:
            """Keep ``u`` gathered after END at ``i``: its next use is within reuse_distance
            need-bearing events, or inside the prefetch window."""
            nxt = next_use[i].get(u)
            if nxt is None:
                return False
            if uses_before[nxt] - (uses_before[i] - 1) <= reuse_distance:
                return True
            if not prefetch or live() > max_live_bytes:
                return False
            return _distinct_bytes(needs, i + 1, nxt, unit_bytes, u, prefetch_bytes) <= prefetch_bytes

        for i, (kind, index) in enumerate(events):
            on_demand: List[Tuple[int, ...]] = []
            fetched: List[Tuple[int, ...]] = []
            release: List[int] = []
            for u in holds.add((kind, index), needs[i]):
                if u in alive and not needed_soon(u, i):
                    alive.discard(u)
                    release.append(u)
            if needs[i]:
                missing = [u for u in needs[i] if u not in alive]
                on_demand = [tuple(g) for g in coalesce(missing)] if missing else []
                alive.update(missing)
                if prefetch:
                    todo = _prefetch(i, needs, alive, unit_bytes, prefetch_bytes, max_live_bytes, live())
                    fetched = [tuple(g) for part in _next_event_apart(i, needs, todo) for g in coalesce(part)]
                    alive.update(todo)
            if holds.in_backward:
                for u in needs[i]:
                    if last_backward_use.get(u) == i and holds.count(u) == 0:
                        alive.discard(u)  # its gradients complete after this use: freed then
            positions.append(Position(tuple(needs[i]), tuple(on_demand), tuple(fetched), tuple(release)))
        return cls(events, positions)


def event_needs(event: Event, module_needs: Sequence[Tuple[int, ...]]) -> Tuple[int, ...]:
    """The units ``event`` needs gathered: a module's units for FORWARD, the unit itself for
    ACCESS and BACKWARD, none for END and BACKWARD_START."""
    kind, index = event
    if kind is EventKind.FORWARD:
        return tuple(module_needs[index])
    if kind in (EventKind.ACCESS, EventKind.BACKWARD):
        return (index,)
    return ()


class Holds:
    """Which running module holds which units, event by event; see [Note: fetch trace].

    A ``FORWARD`` pushes its module with the units it needs; an ``ACCESS`` while a module runs
    adds the unit to the innermost one; that module's ``END`` drops them. ``Schedule.build``
    and the stage-3 coordinator (fetch/unit_fetcher.py) both account for events through this, so
    the schedule's frees and a negotiated step's agree on when a unit is held by nobody."""

    def __init__(self) -> None:
        self.in_backward = False                         # BACKWARD_START seen
        self._stack: List[Tuple[int, List[int]]] = []    # running modules: (module, units it holds)
        self._held: Dict[int, int] = {}                  # unit -> running modules holding it

    def add(self, event: Event, needs: Sequence[int]) -> List[int]:
        """Account for ``event`` (whose units are ``needs``); the units its END leaves held by
        nobody, in forward only (backward frees a unit once its gradients are done)."""
        kind, index = event
        released: List[int] = []
        if kind is EventKind.BACKWARD_START:
            self.in_backward = True
        elif kind is EventKind.END and self._stack and self._stack[-1][0] == index:
            for u in self._stack.pop()[1]:
                self._held[u] -= 1
                if self._held[u] == 0 and not self.in_backward:
                    released.append(u)
        elif kind is EventKind.FORWARD:
            self._stack.append((index, []))
        if kind is EventKind.FORWARD or (kind is EventKind.ACCESS and self._stack):
            for u in needs:  # held by the running module until its END
                self._stack[-1][1].append(u)
                self._held[u] = self._held.get(u, 0) + 1
        return released

    def count(self, unit: int) -> int:
        """How many running modules hold ``unit``."""
        return self._held.get(unit, 0)


def _prefetch(i: int, needs: List[Tuple[int, ...]], alive: set, unit_bytes: Sequence[int],
              prefetch_bytes: int, max_live_bytes: int, live: int) -> List[int]:
    """Units of the events after ``i`` to start gathering now: in trace order, while the bytes
    of the distinct units upcoming events need stay within ``prefetch_bytes`` ([Note: window
    of distinct units]) and the gathered bytes within ``max_live_bytes``; stops at the first
    unit that does not fit."""
    budget, todo, seen = 0, [], set()
    for j in range(i + 1, len(needs)):
        for u in needs[j]:
            if u in seen:
                continue
            seen.add(u)
            nbytes = unit_bytes[u]
            if u not in alive:
                if budget + nbytes > prefetch_bytes or live + nbytes > max_live_bytes:
                    return todo
                todo.append(u)
                live += nbytes
            budget += nbytes
    return todo


def _next_event_apart(i: int, needs: List[Tuple[int, ...]], todo: List[int]) -> List[List[int]]:
    """``todo`` (the prefetch of position ``i``, in trace order) as the parts coalesced apart:
    the units of the next need-bearing event first, on their own, when the prefetch also starts
    later events' units; else all of it as one part.

    [Note: next event apart]
    A unit's wait is its gather's, and coalescing puts a prefetch's units into as few gathers as
    the bucket bound allows. Where one prefetch starts the units of several upcoming events, the
    first of them to run waits for all of them: at a micro-batch's first event, which gathers
    its own units on demand and then prefetches the rest of a model that fits in the window,
    block 0 would start only once the whole model arrived, with nothing to overlap that gather
    with. So when the prefetch includes units of the *next* need-bearing event and of later ones,
    the next event's units go first as a gather of their own and the rest coalesce after them:
    a channel's gathers go out in issue order ([Note: channels] in comm/group.py; on gloo each
    peer's messages in the order they were posted, [Note: gloo point-to-point] in
    comm/exchange.py), so the small one arrives first and the next event computes while the
    rest arrive. The cost is one collective more (a hop's latency, on the communication thread)
    per such split.
    The rule is for the next event only. Where the next event's units are already gathered or
    in flight, the first event to wait for this prefetch runs after at least one event's
    compute, which overlaps the whole prefetch already; splitting there would add a collective
    at every position of a window that slides a block and a part at a time, for little. In the
    steady state the prefetch adds the far end of the window, the next event is ready, and
    nothing splits: in practice the split happens where the window opens, at a micro-batch's
    first event (and at any event that finds the next one not gathered, e.g. after a window too
    small to have held it). The turn to backward needs nothing of its own: the units the
    backward starts with are the forward's last, still gathered (or prefetched like any other
    upcoming event). Like the rest of the schedule this is a function of the trace and the
    configuration only, the same on every rank ([Note: collective order] in comm/group.py)."""
    nxt = next((j for j in range(i + 1, len(needs)) if needs[j]), None)
    if not todo or nxt is None:
        return [todo] if todo else []
    first = set(needs[nxt])
    k = 0
    while k < len(todo) and todo[k] in first:  # the next event's units lead: todo is in trace order
        k += 1
    if k == 0 or k == len(todo):
        return [todo]
    return [todo[:k], todo[k:]]


def _distinct_bytes(needs: List[Tuple[int, ...]], start: int, stop: int, unit_bytes: Sequence[int], unit: int,
                    limit: int) -> int:
    """The bytes of ``unit`` and of the distinct units events ``start..stop-1`` need (counting
    stops once past ``limit``).

    [Note: window of distinct units]
    The prefetch window measures the trace ahead in the bytes of the *distinct* units it
    needs, each counted once however often it is used: that is the memory those units hold if
    they are all gathered, and so what ``prefetch_bytes`` bounds. Counting every use instead
    (a block's units at its forward and again at its backward) made the window shorter than
    its memory: a model smaller than the window still had its first block freed after the
    forward and gathered again for the backward, an all-gather more per step although the
    whole model was gathered at the turn anyway. The prefetcher and the rule that keeps a
    unit gathered (its next use inside the window) count alike."""
    seen, total = {unit}, unit_bytes[unit]
    for j in range(start, stop):
        for v in needs[j]:
            if v not in seen:
                seen.add(v)
                total += unit_bytes[v]
                if total > limit:
                    return total
    return total
