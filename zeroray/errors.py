"""The errors one training step can end in, shared by the engine (raised on a worker) and the
runtime (re-raised on the driver with the worker's rank).

[Note: step outcome]
A step either applies on every worker or on none. When something goes wrong on one worker
in the middle of a step (its ``loss_fn`` raises, its ranks run other modules than the
others), that worker still completes its share of the step's collectives, so no peer is
left waiting, and every worker learns the outcome from the status all-reduce that ends the
step. Then every worker raises: the failing one its own error, the others
``PeerStepError`` naming it. The collective group stays in step and the next step works.
Only a broken group (a dead or hung peer) raises ``CollectiveError`` instead, and the
runtime rebuilds the group.
"""
from __future__ import annotations

from typing import Sequence


class StepError(RuntimeError):
    """A user-visible problem in one step (a bad loss value, non-finite gradients)."""


class TraceMismatchError(RuntimeError):
    """Stage 3: the workers ran different modules in a way that cannot be trained."""


class ParameterAccessError(RuntimeError):
    """Stage 3: a parameter was read where zeroray cannot gather it."""


class PeerStepError(RuntimeError):
    """This worker's step was not applied because another worker's step failed.

    ``ranks``: the workers whose step failed; their own errors say why."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, a connection broke, a timeout): the group cannot continue."""


class UnrecoverableDivergence(TraceMismatchError, CollectiveError):
    """Stage 3 over a backend that cannot negotiate mid-step (NCCL): the workers ran different
    modules and their collectives no longer match, so the group must be rebuilt."""
