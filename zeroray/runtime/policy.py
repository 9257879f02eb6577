"""Failure and scaling policies: small objects that return a decision and do nothing else.

The controller (trainer.py) acts on the decision; the policies are testable without a cluster.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Action(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


class FailurePolicy:
    """Restart after a worker failure until ``max_failures`` have happened, then raise."""

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.failures = 0

    def on_failure(self, error: BaseException, user_error: bool) -> Decision:
        if user_error:
            return Decision(Action.RAISE, f"the error comes from user code or input: {type(error).__name__}")
        self.failures += 1
        if self.failures > self.max_failures:
            return Decision(Action.RAISE, f"{self.failures} worker failure(s), max_failures={self.max_failures}")
        return Decision(Action.RESTART, f"worker failure {self.failures} of at most {self.max_failures}: "
                                        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


class ScalingPolicy:
    """How many workers to restart with: what the cluster offers, between min and the target."""

    def __init__(self, target: int, minimum: Optional[int], cpus_per_worker: float, use_gpu: bool) -> None:
        self.target, self.minimum = target, minimum or target
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu

    def workers_for(self, free_cpus: float, free_gpus: float) -> int:
        fit = int(free_cpus // self.cpus_per_worker + 1e-9)
        if self.use_gpu:
            fit = min(fit, int(free_gpus))
        return max(self.minimum, min(self.target, fit))
