"""Between steps: turn the agreed arrival timelines into the next bucket plan.

The tuner holds what carries over from step to step: the smoothed timeline, the current
capacity and cuts, and the log of size changes. It sees only numbers every rank agrees on
(the timeline after the status all-reduce) and is deterministic, so every rank's tuner
proposes the same plan at the same step ([Note: bucket timeout] in bucket_plan.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from zeroray.comm.bucket_plan import Timeline, auto_capacity, simulate

log = logging.getLogger("zeroray")

# "auto" without a given timeout: the timeout is the measured backward over this number
# ([Note: bucket sizing] in bucket_plan.py; what it gives is in benchmarks/README.md).
AUTO_BUCKETS_PER_BACKWARD = 8


@dataclass(frozen=True)
class Plan:
    capacity_bytes: int
    cuts: frozenset


class BucketTuner:
    """Proposes the bucket plan from measured steps: timeout cuts, and with ``auto`` the size.

    ``order``/``columns``/``column_bytes`` describe the reducer's units (plan order, columns
    per unit, bytes per column). ``timeout_ms``: the flush timeout (None with ``auto``: the
    measured backward over ``AUTO_BUCKETS_PER_BACKWARD``)."""

    def __init__(self, order: Sequence[int], columns: Dict[int, int], column_bytes: int, *,
                 capacity_bytes: int, timeout_ms: Optional[float], auto: bool) -> None:
        self.order, self.columns, self.column_bytes = list(order), dict(columns), column_bytes
        self.auto = auto
        self.derived_timeout = timeout_ms is None
        self.timeout_us = int(round(timeout_ms * 1000)) if timeout_ms is not None else 0
        self.plan = Plan(capacity_bytes, frozenset())
        self.smoothed: Optional[Timeline] = None
        self.changes: List[Tuple[int, int, int]] = []  # (step, old bytes, new bytes)
        self.steps_seen = 0
        self.steps_learned = 0

    @property
    def timeout_ms(self) -> Optional[float]:
        """The flush timeout in force (None: derived, and nothing measured yet)."""
        return self.timeout_us / 1000 if self.timeout_us else None

    def vector_numel(self) -> int:
        """Numbers one rank adds to the status all-reduce: first and last arrival per unit, end."""
        return 2 * len(self.order) + 1

    def encode(self, timeline: Timeline) -> List[float]:
        return ([float(timeline.first[u]) for u in self.order] + [float(timeline.done[u]) for u in self.order]
                + [float(timeline.end)])

    def decode_mean(self, summed: Sequence[float], world_size: int) -> Timeline:
        """The mean timeline from the all-reduced sum (integers: every rank rounds the same)."""
        n = len(self.order)
        mean = [int(round(x / world_size)) for x in summed]
        return Timeline(dict(zip(self.order, mean[:n])), dict(zip(self.order, mean[n:2 * n])), mean[2 * n])

    def observe(self, step: int, timeline: Timeline, learn: bool = True) -> Optional[Plan]:
        """After step ``step`` (counted from 1): learn from its agreed timeline unless ``learn`` is
        False or it is the first step this tuner sees (allocators warm up in it); the new plan if
        it differs from the current one, else None."""
        self.steps_seen += 1
        if not learn or self.steps_seen == 1:
            return None
        self.steps_learned += 1
        self.smoothed = timeline if self.smoothed is None else _average(self.smoothed, timeline)
        if self.derived_timeout:
            self.timeout_us = max(self.smoothed.end // AUTO_BUCKETS_PER_BACKWARD, 1)
        capacity = self.plan.capacity_bytes
        if self.auto:
            capacity = auto_capacity(self.order, self.columns, self.smoothed, self.timeout_us, capacity,
                                     self.column_bytes)
            if capacity != self.plan.capacity_bytes:
                self.changes.append((step, self.plan.capacity_bytes, capacity))
                log.info("zeroray: bucket_bytes='auto' after step %d: gradient buckets %s -> %s (largest run of "
                         "gradients arriving within %g ms of each other)", step,
                         _mib(self.plan.capacity_bytes), _mib(capacity), self.timeout_ms)
        columns = max(capacity // self.column_bytes, 1)
        cuts = simulate(self.order, self.columns, columns, self.smoothed, self.timeout_us).cuts
        plan = Plan(capacity, cuts)
        if plan == self.plan:
            return None
        self.plan = plan
        return plan


def _average(old: Timeline, new: Timeline) -> Timeline:
    """Half the old, half the new, in whole microseconds: one slow step moves a plan halfway."""
    def mix(a: int, b: int) -> int:
        return (a + b) // 2
    return Timeline({u: mix(old.first[u], new.first[u]) for u in new.first},
                    {u: mix(old.done[u], new.done[u]) for u in new.done}, mix(old.end, new.end))


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"
