"""One engine call at a time, in the order the driver sent them: tickets and the worker's sequencer.

[Note: one engine call at a time]
The worker actor is threaded (Ray Train v2's pattern), so it answers the driver's health and
progress polls while a step runs. Ray gives no order between calls queued on a threaded actor,
yet ``fit`` keeps the next step queued behind the current one, and a save must run after the
step it saves. So the driver numbers every call that touches the engine, per worker (a
``Ticket``), and the worker's ``Sequencer`` runs them strictly in that order, one at a time;
only the polls bypass it. A ticket with ``after_ok`` runs only if the call before it succeeded:
that is how a step queued behind a failing step is dropped (it returns ``Cancelled`` and never
touches the engine) instead of training on after the error. Every number the driver hands out
must reach the worker, or the calls behind it wait forever; a group whose calls fail to reach
its workers is torn down (worker_group/group.py), which ends every waiting call with it.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Ticket:
    """A call's place in its worker's sequence; see [Note: one engine call at a time]."""

    seq: int
    after_ok: bool = False  # run only if the call numbered seq - 1 succeeded


class Cancelled:
    """What a call returns when it did not run because the call before it failed (``after_ok``)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def __repr__(self) -> str:
        return f"Cancelled(seq={self.seq})"


class Sequencer:
    """Runs calls in ticket order, one at a time, on whichever thread Ray delivered each to."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next = 0          # the ticket whose turn it is
        self._last_ok = True    # whether the call before it succeeded
        self.busy = False       # a call is running now (what progress polls report)

    def run(self, ticket: Ticket, call: Callable[[], Any]) -> Any:
        with self._turn:
            if ticket.seq < self._next:
                raise RuntimeError(f"call number {ticket.seq} arrived after call {self._next - 1} ran: "
                                   "the driver numbered two calls alike (a zeroray bug)")
            self._turn.wait_for(lambda: self._next == ticket.seq)
            self.busy = True
        ok = False
        try:
            if ticket.after_ok and not self._last_ok:
                return Cancelled(ticket.seq)
            result = call()
            ok = True
            return result
        finally:
            with self._turn:
                self._last_ok = ok
                self._next += 1
                self.busy = False
                self._turn.notify_all()


def engine_call(method: Optional[Callable] = None, *, waits_for_copy: bool = True) -> Callable:
    """An actor method that touches the engine: called as ``method(ticket, *args)``, it runs in
    its ticket's turn (see [Note: one engine call at a time]), and once the snapshot copy before
    it is done (the actor's ``snapshots``, snapshot_side.py: [Note: overlapped snapshot copy] in
    runtime/snapshot.py); ``waits_for_copy=False``: a step, which waits for it only before its update."""
    if method is None:
        return functools.partial(engine_call, waits_for_copy=waits_for_copy)

    def call(self: Any, ticket: Ticket, *args: Any, **kwargs: Any) -> Any:
        self._arrived.at = time.time()  # before waiting for the turn: the step timeline's actor_start

        def run() -> Any:
            if waits_for_copy:
                self.snapshots.wait_copy()
            return method(self, *args, **kwargs)
        return self._sequencer.run(ticket, run)

    call.__name__, call.__qualname__, call.__doc__ = method.__name__, method.__qualname__, method.__doc__
    # What crosses the boundary (tests/unit/test_worker_boundary.py): the method's annotations, to
    # be resolved in the method's module. No __wrapped__: Ray unwraps an actor method before it
    # reads its signature, and would lose the ticket.
    call.__annotations__, call.__module__ = method.__annotations__, method.__module__
    # Ray checks call arguments against the signature: the same one, with the ticket first.
    signature = inspect.signature(method)
    params = list(signature.parameters.values())
    call.__signature__ = signature.replace(parameters=[
        params[0], inspect.Parameter("ticket", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params[1:]])
    return call
