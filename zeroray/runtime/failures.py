"""What can go wrong with a worker group, how each error is classified, and how a worker's
error reaches the user.

[Note: worker errors on the driver]
Ray hands the driver a worker's exception wrapped in ``RayTaskError``, whose message starts
with the actor's repr and the worker's traceback. zeroray raises the worker's own exception
instead: its own type (zeroray's, such as ``StepError`` or ``CheckpointError``, or the
user's, such as a ``KeyError`` from ``loss_fn``) and its own message, with a note naming the
worker (rank, pid, node) and the call. The worker's traceback is the exception's
``__cause__`` (a ``WorkerTraceback``), so it prints above the error, as a chained cause does.
An exception that could not travel (it does not pickle) arrives as a ``WorkerError`` with the
worker's message and traceback. Errors of the group itself (a dead worker, a broken
connection, a hung collective) are ``WorkerGroupError`` errors, raised after the group was torn down.
"""
from __future__ import annotations

import enum
from typing import Optional, Sequence

import ray.exceptions as rex

from zeroray.errors import CollectiveError, PeerStepError


class PlacementError(RuntimeError):
    """The cluster cannot offer the placement group within ``placement_timeout_s``."""


class WorkerSetupError(RuntimeError):
    """Building a worker's model or engine failed (model_fn, the optimizer spec, the collective group)."""


class WorkerError(RuntimeError):
    """An exception raised on a worker whose own type could not be brought to the driver."""


class WorkerTraceback(Exception):
    """The traceback of an exception raised on a worker: the ``__cause__`` of that exception on the driver."""


class WorkerGroupError(RuntimeError):
    """The group cannot continue: a worker died, a peer connection broke or a collective hung.

    Raised on the driver after the group was torn down; fit restarts on it (FailureConfig).
    ``ranks`` are the workers to blame (dead, or did not arrive); ``cause`` the first error seen.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.ranks, self.cause = list(ranks), cause


class WorkerDiedError(WorkerGroupError):
    """A worker's process or node is gone."""


class CollectiveTimeoutError(WorkerGroupError, TimeoutError):
    """A collective did not complete within ZeroConfig.collective_timeout_s."""


class ErrorKind(enum.Enum):
    """Who is to blame for an error a call to a worker ended in."""

    DIED = "died"        # the worker is gone (restartable)
    PEER = "peer"        # its peer vanished: a broken connection (restartable)
    TIMEOUT = "timeout"  # a collective hung (restartable)
    PEER_STEP = "peer_step"  # this worker's step was dropped because another worker's failed
    USER = "user"        # user code or input: raised as it is, never retried


# Text of the errors a surviving rank raises when its peer vanished (gloo over TCP, NCCL).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "socket closed", "nccl communicator was aborted", "ncclremoteerror")
_TIMED_OUT = ("timed out waiting", "watchdog caught collective operation timeout", "operation timed out")

_DIED = tuple(k for k in (getattr(rex, n, None) for n in (
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
    "NodeDiedError", "OwnerDiedError", "ObjectLostError", "ActorPlacementGroupRemoved")) if k is not None)


def classify_error(error: BaseException) -> ErrorKind:
    """The kind of an error from a call to a worker (what ray.get raised), see ErrorKind."""
    if isinstance(error, WorkerDiedError) or isinstance(error, _DIED):
        return ErrorKind.DIED
    if isinstance(error, (CollectiveTimeoutError, TimeoutError)):
        return ErrorKind.TIMEOUT
    if isinstance(error, WorkerGroupError):
        return ErrorKind.PEER
    cause = getattr(error, "cause", None) if isinstance(error, rex.RayTaskError) else error
    if isinstance(cause, PeerStepError):
        return ErrorKind.PEER_STEP
    if isinstance(error, rex.RayTaskError) or isinstance(cause, CollectiveError):
        # Only the worker's own exception message counts, not the traceback around it.
        text = (str(cause) if cause is not None else (str(error).strip().splitlines() or [""])[-1]).lower()
        if isinstance(cause, CollectiveError):  # the engine says the group is broken; see zeroray/errors.py
            timed_out = isinstance(cause, TimeoutError) or "timed out" in text or "timeout" in text
            return ErrorKind.TIMEOUT if timed_out else ErrorKind.PEER
        if any(k in text for k in _PEER_LOST):
            return ErrorKind.PEER
        if any(k in text for k in _TIMED_OUT):
            return ErrorKind.TIMEOUT
    return ErrorKind.USER


def is_worker_failure(error: BaseException) -> bool:
    """A dead, unreachable or hung worker (restartable), as opposed to an error in user code or input."""
    return classify_error(error) in (ErrorKind.DIED, ErrorKind.PEER, ErrorKind.TIMEOUT)


def worker_error(error: BaseException, who: str) -> BaseException:
    """The exception to raise on the driver for ``error`` from a worker; see [Note: worker errors
    on the driver]. ``who`` names the worker and the call, e.g. "worker 1 (pid 7 on 10.0.0.2) during step 3"."""
    if not isinstance(error, rex.RayTaskError):
        return error
    cause = getattr(error, "cause", None)
    # Ray's error is the traceback text (a dual-class instance has no traceback_str of its own).
    trace = WorkerTraceback(f"{who}:\n{getattr(error, 'traceback_str', '') or str(error)}".rstrip())
    if not isinstance(cause, BaseException) or isinstance(cause, rex.RayError):
        text = str(cause if cause is not None else error).strip()
        out: BaseException = WorkerError(f"{text.splitlines()[-1] if text else 'an error'} (raised on {who})")
    else:
        out = cause
        out.add_note(f"zeroray: raised on {who}; the worker's traceback is printed above")
    out.__cause__ = trace
    return out


def setup_error(error: BaseException) -> BaseException:
    """The worker's own error, with its traceback, as the error of Trainer construction."""
    cause = getattr(error, "cause", None)
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(error).strip().splitlines()[-1]
    message = (f"setting up the workers failed: {what}\n"
               "Every worker calls torch.manual_seed(seed), model_fn(), builds the optimizer from its spec "
               "and joins the collective group; fix the error above (the worker's traceback follows). "
               "No actors were left running.\n--- worker traceback ---\n"
               f"{getattr(error, 'traceback_str', '') or str(error)}")
    # A user error keeps its type (ValueError for bad input), anything else is a WorkerSetupError.
    return ValueError(message) if isinstance(cause, ValueError) else WorkerSetupError(message)


def first_line(error: Optional[BaseException]) -> str:
    """``Type: first line of the message`` of an error, or of the worker exception inside it."""
    if error is None:
        return "no error"
    cause = getattr(error, "cause", None)
    text = str(cause if cause is not None else error).strip()
    first = text.splitlines()[0].rstrip(". ") if text else ""
    return f"{type(cause if cause is not None else error).__name__}: {first}"
