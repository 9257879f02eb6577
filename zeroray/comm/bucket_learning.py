"""The gradient buckets' side of the step's status all-reduce: what a rank contributes to it,
and what every rank does with the agreed sum ([Note: bucket timeout] in bucket_plan.py).

With fixed buckets there is nothing to learn: no tuner, no numbers added to the status
all-reduce, and the stats of the last step only. With a flush timeout or ``"auto"`` the
tuner (bucket_tuner.py) turns the agreed arrival timelines into the next plan, which is
installed on the reducer between steps.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from zeroray.comm.bucket_tuner import BucketTuner
from zeroray.comm.buckets import GradBuckets
from zeroray.config import ZeroConfig


class BucketLearning:
    def __init__(self, reducer: GradBuckets, zero: ZeroConfig) -> None:
        self.reducer = reducer
        self.tuner: Optional[BucketTuner] = None
        if zero.buckets_planned:
            self.tuner = BucketTuner(reducer.unit_order, reducer.unit_columns, reducer.column_bytes,
                                     capacity_bytes=reducer.bucket_bytes, timeout_ms=zero.bucket_timeout_ms,
                                     auto=zero.bucket_bytes == "auto")
        self._last = self._take()

    def _take(self) -> Dict[str, Any]:
        return {**self.reducer.take_stats(), "bucket_bytes": self.reducer.bucket_bytes}

    def arrivals(self) -> List[float]:
        """This rank's share of the status all-reduce (nothing without a tuner)."""
        tuner, timeline = self.tuner, self.reducer.last_timeline
        if tuner is None:
            return []
        return tuner.encode(timeline) if timeline is not None else [0.0] * tuner.vector_numel()

    def after_step(self, step: int, summed: Sequence[float], world_size: int, learn: bool) -> None:
        """After the status all-reduce of step ``step`` (counted from 1), on every rank alike: keep
        its bucket counts, and install the plan the tuner draws from the agreed arrivals
        (``learn``: not from a failed step, nor a negotiated stage-3 step, whose ranks ran
        different modules)."""
        self._last = self._take()
        if self.tuner is None:
            return
        plan = self.tuner.observe(step, self.tuner.decode_mean(summed, world_size), learn)
        if plan is not None:
            self.reducer.replan(plan.capacity_bytes, plan.cuts)

    def stats(self) -> Dict[str, Any]:
        """The gradient buckets of the last step: how many were launched full, by the flush
        timeout, and at the end of backward; the mean wait of a bucket's first gradient (arrival
        to launch, this rank); the time this rank blocked on reductions (their share of
        ``exposed_s``); their size; with "auto", the size changes so far as (step after which it
        changed, old, new)."""
        s, tuner = self._last, self.tuner
        stats = {"buckets_full": s["full"], "buckets_timeout": s["timeout"], "buckets_end": s["end"],
                 "bucket_first_wait_ms": s["first_wait_ms"], "bucket_blocked_ms": s["blocked_ms"],
                 "bucket_bytes": s["bucket_bytes"],
                 "bucket_timeout_ms": tuner.timeout_ms if tuner is not None else None}
        if tuner is not None and tuner.auto:
            stats["bucket_size_changes"] = [list(change) for change in tuner.changes]
        return stats
