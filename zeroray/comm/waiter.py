"""Waiting for a collective while still hearing from the other ranks.

A rank blocked in a wait cannot see that a peer left the step's plan and now waits for it
in an agreement round (see [Note: plan exit] in fetch/unit_fetcher.py). So every blocking wait of the
engine goes through one ``Waiter``: on backends whose waits block the host (gloo) it waits
in slices of ``interval_s`` and calls ``poll`` between them; ``poll`` may take part in what
a peer waits for (leave the plan, answer its agreement round) before waiting on. On NCCL a
wait only orders streams and returns at once, so there is nothing to poll.
"""
from __future__ import annotations

from typing import Callable, Optional


class Waiter:
    """The engine's one way to wait for a collective. ``poll``: what to do between slices of a
    blocking wait; the stage-3 coordinator sets it while it exists (fetch/unit_fetcher.py), and
    with none a wait is a plain ``handle.wait()``."""

    def __init__(self, blocking_waits: bool, interval_s: float = 0.05) -> None:
        self.blocking_waits, self.interval_s = blocking_waits, interval_s
        self.poll: Optional[Callable[[], None]] = None

    def __call__(self, handle) -> None:
        """Wait for ``handle``, polling between slices where waits block the host."""
        if not self.blocking_waits or self.poll is None:
            handle.wait()
            return
        while not handle.wait_for(self.interval_s):
            self.poll()

    def until_complete(self, handle) -> None:
        """Block the host until ``handle`` completed, polling meanwhile, on every backend (the
        step's status all-reduce: its result is read on the host right after)."""
        if self.blocking_waits or self.poll is None:
            self(handle)
            return
        import time

        while not handle.is_completed():
            self.poll()
            time.sleep(0.005)
        handle.wait()
