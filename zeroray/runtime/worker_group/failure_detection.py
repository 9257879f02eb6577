"""Saying who failed, and how, when a worker group's calls did not all come back.

[Note: failure detection]
The driver waits for one call per worker (``WorkerGroup.wait_all``, group.py) with ``ray.wait``
in short polls and looks at every result as soon as it arrives. A killed worker shows up twice,
within about a second: Ray fails the dead actor's call (RayActorError), and each survivor's gloo
call fails on the closed connection ("Connection reset by peer"). A rank that never reaches a
collective makes the others' gloo calls time out after ``collective_timeout_s``. After the first
error the driver listens ``FAILURE_GRACE_S`` more for the rest, then decides: a death
(WorkerDiedError) wins over a broken connection (WorkerGroupError) or a timeout
(CollectiveTimeoutError, naming the ranks that issued fewer collectives: they did not arrive);
otherwise the failing worker's own error is raised (see failures.py), not the ``PeerStepError``
errors of the workers whose step was dropped because of it. That decision is the
``FailureDetector``'s: it is given what came back and what the group knows of its workers, and
returns a ``Verdict`` (the error, and whether the group is torn down) that the group acts on.
Whenever the workers are left out of step with each other, the driver kills them all (ray.kill)
before raising: survivors blocked in a collective are never waited for. An error that every
worker raised together (the engine's step outcome, see zeroray/errors.py) leaves the group
usable. The controller's recovery restarts on the first three kinds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray

from zeroray.comm.group import RendezvousError
from zeroray.runtime.failures import (CollectiveTimeoutError, ErrorKind, WorkerDiedError, WorkerGroupError,
                                      classify_error, first_line, worker_error)
from zeroray.runtime.records import NodeInfo

# How long wait_all keeps listening for the other workers after the first error: long enough
# for Ray to report a killed actor (well under a second), short enough to fail fast.
FAILURE_GRACE_S = 3.0


@dataclass(frozen=True)
class Verdict:
    """What a failed wait_all ends in: ``error``, to raise (its cause chained as ``raise ... from``
    would); and unless the group stays usable (``reason`` None), why it is torn down and the ranks
    it keeps for a replacement (``keep``: their call came back; with keep_survivors, [Note:
    replace, don't restart] in reform.py)."""

    error: BaseException
    reason: Optional[str] = None
    keep: Tuple[int, ...] = ()


def _raised_from(error: BaseException, cause: Optional[BaseException]) -> BaseException:
    """``error`` as ``raise error from cause`` raises it."""
    error.__cause__ = cause
    return error


class FailureDetector:
    """The judge of a failed wait_all ([Note: failure detection]): which ranks died, hung or lost
    a peer, and which error explains it. It holds the timeouts it names; the group's workers (their
    actors, to ask how far each got, and their nodes, to name them) are given with each failure."""

    def __init__(self, collective_timeout_s: float, rendezvous_timeout_s: float) -> None:
        self.collective_timeout_s = collective_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s  # a re-form's ([Note: rendezvous timeout] in reform.py)

    def judge(self, errors: Dict[int, BaseException], pending: List[int], what: str, *, succeeded: Sequence[int],
              answered: Sequence[int], actors: Sequence[Any], nodes: Sequence[NodeInfo],
              keep_survivors: bool) -> Verdict:
        """The verdict on a wait_all that did not return: ``errors`` by rank, the ranks still
        ``pending``, those whose call ``succeeded`` while others failed in a collective step, and
        those that ``answered`` (a result came back). See [Note: failure detection]."""
        kinds = {rank: classify_error(e) for rank, e in errors.items()}
        dead = sorted(r for r, k in kinds.items() if k is ErrorKind.DIED)
        alive = sorted((set(errors) | set(answered)) - set(dead))
        if dead:
            cause = errors[dead[0]]
            message = (f"{what}: worker(s) {_describe(dead, nodes)} died: {first_line(cause)}. " + (
                "The other workers were kept: fit replaces the lost one(s) and resumes from the in-memory snapshot"
                if keep_survivors and alive else
                "The worker group was shut down; fit restarts from the last checkpoint when "
                "FailureConfig(max_failures) allows it"))
            return Verdict(_raised_from(WorkerDiedError(message, dead, cause), cause), message, tuple(alive))
        users = sorted(r for r, k in kinds.items() if k in (ErrorKind.USER, ErrorKind.PEER_STEP))
        if users:
            # The failing worker's own error; the others' PeerStepErrors only say that it failed.
            own = [r for r in users if kinds[r] is ErrorKind.USER] or users
            error = worker_error(errors[own[0]], f"worker {_describe(own[:1], nodes)[1:-1]} during {what}")
            stuck = sorted(set(pending) | (set(errors) - set(users)))
            if not (stuck or succeeded):
                return Verdict(error)  # every worker raised it together: the group stays usable
            # they wait (or timed out waiting) in a collective, or went on without them
            message = (f"worker(s) {own} raised during {what} while worker(s) {stuck} waited in a collective"
                       if stuck else f"worker(s) {own} raised during {what} while worker(s) {list(succeeded)} "
                       "completed it")
            error.add_note(f"zeroray: {message}, so the worker group was shut down: build a new Trainer "
                           "or zr.Trainer.restore(...) from a checkpoint")
            return Verdict(error, message)
        broken = sorted(errors)  # every error is a broken connection or a timed-out collective
        late = _late_ranks(pending, actors)
        timed_out = [r for r in broken if kinds[r] is ErrorKind.TIMEOUT]
        cause = errors[broken[0]] if broken else None
        kept = tuple(sorted(set(alive) - set(late)))
        if timed_out and all(isinstance(getattr(errors[r], "cause", errors[r]), RendezvousError) for r in timed_out):
            message = (f"{what}: the rendezvous did not complete within rendezvous_timeout_s="
                       f"{self.rendezvous_timeout_s:g} s on worker(s) {_describe(timed_out, nodes)}, and no worker "
                       "died ([Note: rendezvous timeout]): a loaded machine; "
                       + (f"worker(s) {_describe(late, nodes)} did not answer and are replaced; " if late else "")
                       + ("the others were kept, the re-form is tried again" if keep_survivors else
                          "the worker group was shut down"))
            return Verdict(_raised_from(CollectiveTimeoutError(message, late, cause), cause), message, kept)
        if timed_out or not errors:  # not errors: nothing came back before the driver's deadline
            waited = f"; worker(s) {_describe(timed_out, nodes)} waited for them and timed out" if timed_out else ""
            message = (f"{what}: a collective did not complete within collective_timeout_s="
                       f"{self.collective_timeout_s:g} s: worker(s) {_describe(late, nodes) if late else '(unknown)'} "
                       f"did not arrive{waited}. Every worker must run the same forward/backward (same modules, "
                       "same number of micro-batches); if one is just slow (data loading, a long first step), "
                       "raise ZeroConfig(collective_timeout_s=...). The worker group was shut down")
            return Verdict(_raised_from(CollectiveTimeoutError(message, late, cause), cause), message, kept)
        message = (f"{what}: worker(s) {_describe(broken, nodes)} lost the connection to a peer "
                   f"({first_line(cause)}); worker(s) {_describe(late, nodes) if late else '(unknown)'} "
                   "probably died or became unreachable. The worker group was shut down")
        return Verdict(_raised_from(WorkerGroupError(message, late, cause), cause), message, kept)


def _late_ranks(pending: List[int], actors: Sequence[Any]) -> List[int]:
    """Ranks that did not reach the collective the others are in: fewest collectives issued this step."""
    refs = {}
    for rank, actor in enumerate(actors):
        try:
            refs[rank] = actor.progress.remote()
        except Exception:  # noqa: BLE001 - a dead actor has no progress
            pass
    progress = {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
    for rank, ref in refs.items():
        if ref in ready:
            try:
                p = ray.get(ref)
                progress[rank] = (p.step or 0, p.collectives)
            except Exception:  # noqa: BLE001
                pass
    if len(set(progress.values())) > 1:
        ahead = max(progress.values())
        return sorted(r for r, p in progress.items() if p < ahead)
    return sorted(pending)


def _describe(ranks: Sequence[int], nodes: Sequence[NodeInfo]) -> str:
    where = []
    for r in ranks:
        node = nodes[r] if r < len(nodes) else None
        where.append(f"{r} (pid {node.pid} on {node.ip})" if node else str(r))
    return "[" + ", ".join(where) + "]"
