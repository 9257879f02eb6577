"""Failure and scaling policies: small objects that return a decision and do nothing else.

The Controller's recovery (controller/recovery.py) builds one of each per fit, at its first failure,
and acts on their decisions (``Recovery.recover`` asks the FailurePolicy whether to restart,
``Recovery._restart`` asks the ScalingPolicy how many workers to restart with, ``Recovery._replace``
whether to go on with the survivors when no replacement can be placed). The policies are testable
without a cluster (tests/unit/test_policy.py). Which errors count as worker failures is decided in
failures.py (``classify_error``, ``is_worker_failure``), and recovery passes that verdict on
(``user_error``); the policy only counts the failures.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Action(enum.Enum):
    """What to do about a worker failure."""

    RESTART = "restart"  # rebuild the group at its full size, resume from the last checkpoint
    RESIZE = "resize"    # rebuild it smaller: the cluster offers fewer workers (down to min_workers)
    RAISE = "raise"      # give up: the error goes to the caller


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the action, why, and (restart or resize) the new group's size."""

    action: Action
    reason: str
    num_workers: Optional[int] = None  # RESTART / RESIZE from ScalingPolicy: the new group's size


class FailurePolicy:
    """Restart after a worker failure until ``max_failures`` have happened, then raise.

    Errors in user code or input are never retried: the same step would fail the same way.
    """

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.failures = 0

    @property
    def exhausted(self) -> bool:
        """True once more worker failures happened than max_failures allows."""
        return self.failures > self.max_failures

    def on_failure(self, error: BaseException, user_error: bool) -> Decision:
        if user_error:
            return Decision(Action.RAISE, f"the error comes from user code or input: {type(error).__name__}")
        self.failures += 1
        if self.exhausted:
            return Decision(Action.RAISE, f"{self.failures} worker failure(s), more than "
                                          f"FailureConfig.max_failures={self.max_failures}")
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Decision(Action.RESTART, f"worker failure {self.failures} of at most {self.max_failures}: "
                                        f"{type(error).__name__}: {first}")


class ScalingPolicy:
    """How many workers to restart with: what the cluster offers, between min_workers and the target."""

    def __init__(self, target: int, minimum: Optional[int], cpus_per_worker: float, use_gpu: bool) -> None:
        self.target, self.minimum = target, minimum or target
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu

    def fits(self, free_cpus: float, free_gpus: float) -> int:
        """Workers the free resources hold (may be 0 or more than the target)."""
        fit = int(free_cpus // self.cpus_per_worker + 1e-9)
        if self.use_gpu:
            fit = min(fit, int(free_gpus))
        return fit

    def workers_for(self, free_cpus: float, free_gpus: float) -> int:
        return max(self.minimum, min(self.target, self.fits(free_cpus, free_gpus)))

    def on_lost(self, survivors: int) -> Decision:
        """No replacement could be placed for the lost workers ([Note: shrink in memory] in
        worker_group/reform.py): go on with the survivors when they are at least min_workers (RESIZE to
        their number), else RESTART at the size ``on_restart`` decides."""
        if survivors >= self.minimum:
            return Decision(Action.RESIZE, f"no replacement could be placed: continue with the {survivors} "
                                           f"surviving worker(s) (min_workers={self.minimum})", survivors)
        return Decision(Action.RESTART, f"no replacement could be placed and the {survivors} surviving worker(s) "
                                        f"are fewer than min_workers={self.minimum}: restart the group")

    def on_restart(self, free_cpus: float, free_gpus: float) -> Decision:
        fit = self.fits(free_cpus, free_gpus)
        n = self.workers_for(free_cpus, free_gpus)
        offer = f"the cluster has room for {fit} worker(s)"
        if fit >= self.target:
            return Decision(Action.RESTART, f"{offer}: restart with all {self.target}", n)
        if fit >= self.minimum:
            return Decision(Action.RESIZE, f"{offer}: continue with {n} of {self.target} (min_workers="
                                           f"{self.minimum})", n)
        # Fewer than min_workers fit now: ask for min_workers and let the placement group wait
        # (placement_timeout_s) for the cluster to free or add resources.
        return Decision(Action.RESIZE if n < self.target else Action.RESTART,
                        f"{offer}, fewer than min_workers={self.minimum}: wait for {n}", n)
