"""A training step seen from the driver: in flight (``PendingStep``) and done (``StepResult``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from zeroray.runtime.records import StepRecord


@dataclass
class StepResult:
    """What one optimizer step returned: the global loss, the grad norm, the step number.

    ``timeline``: when the step passed each hop, ``time.time()`` seconds: the driver's
    ``submit``, rank 0's ``actor_start`` (the call arrived), ``engine_start`` (its turn came),
    ``engine_end``, and the driver's ``receive`` (benchmarks/ray_overhead.py reads them).
    """

    loss: float            # mean over the global batch
    grad_norm: float       # global L2 norm before clipping
    step: int              # optimizer steps taken so far (this one included)
    skipped: bool = False  # fp16 overflow: the update was skipped on every worker
    loss_scale: Optional[float] = None
    step_time_s: float = 0.0
    evaluation: Optional[Dict[str, float]] = None  # fit: the evaluation that followed this step, if one did
    timeline: Optional[Dict[str, float]] = field(default=None, repr=False, compare=False)


@dataclass
class PendingStep:
    """A step sent to every worker whose results were not collected yet (StepPipeline.collect).

    ``refs``: one object ref per worker, rank order. ``tokens``: elements of the largest tensor
    of the global batch (progress's tokens/s), when known.
    """

    refs: List[Any]
    submitted_at: float
    number: int                  # the step count this step ends at, if it runs
    tokens: Optional[int] = None
    snapshot: Optional[Any] = None  # fit: the in-memory snapshot taken right behind it (runtime/snapshot.py)

    @staticmethod
    def combine(results: List[StepRecord]) -> StepResult:
        """The StepResult of the workers' per-rank records (rank order): the mean of their losses
        (each weighted by its rows), rank 0's global values, the slowest engine's time."""
        r0 = results[0].stats
        return StepResult(loss=sum(r.stats.loss for r in results) / len(results), grad_norm=r0.grad_norm,
                          step=r0.step, skipped=r0.skipped, loss_scale=r0.loss_scale,
                          step_time_s=max(r.stats.time_s for r in results))
