"""A training step seen from the driver once it is done: ``StepResult`` (in flight, it is
execution/pipeline.py's ``PendingStep``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


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
