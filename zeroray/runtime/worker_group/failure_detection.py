"""Waiting for a worker group's calls, and saying who failed and how.

[Note: failure detection]
The driver waits for one call per worker (``wait_all``) with ``ray.wait`` in short polls and
looks at every result as soon as it arrives. A killed worker shows up twice, within about a
second: Ray fails the dead actor's call (RayActorError), and each survivor's gloo call fails
on the closed connection ("Connection reset by peer"). A rank that never reaches a collective
makes the others' gloo calls time out after ``collective_timeout_s``. After the first error
the driver listens ``FAILURE_GRACE_S`` more for the rest, then decides: a death
(WorkerDiedError) wins over a broken connection (WorkerGroupError) or a timeout
(CollectiveTimeoutError, naming the ranks that issued fewer collectives: they did not
arrive); otherwise the failing worker's own error is raised (see failures.py), not the
``PeerStepError`` errors of the workers whose step was dropped because of it. Whenever the workers
are left out of step with each other, the driver kills them all (ray.kill) before raising:
survivors blocked in a collective are never waited for. An error that every worker raised
together (the engine's step outcome, see zeroray/errors.py) leaves the group usable. The
controller's recovery restarts on the first three kinds.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import ray

from zeroray.comm.group import RendezvousError
from zeroray.runtime.failures import (CollectiveTimeoutError, ErrorKind, WorkerDiedError, WorkerGroupError,
                                      classify_error, first_line, worker_error)
from zeroray.runtime.worker_group.placement import kill

log = logging.getLogger("zeroray")

# How long wait_all keeps listening for the other workers after the first error: long enough
# for Ray to report a killed actor (well under a second), short enough to fail fast.
FAILURE_GRACE_S = 3.0


class FailureDetection:
    """``wait_all`` and its analysis of a failure; mixed into ``WorkerGroup`` (group.py), whose state it is."""

    def wait_all(self, refs: List[Any], timeout_s: Optional[float], what: str,
                 ranks: Optional[Sequence[int]] = None, lockstep: bool = False,
                 independent: bool = False, grace_s: float = FAILURE_GRACE_S) -> List[Any]:
        """ray.get of one call per worker (refs in the order of ``ranks``, default all), failing fast
        and saying who failed.

        See [Note: failure detection]. Returns the results in order, or raises: the worker's own
        error ([Note: worker errors on the driver] in failures.py), WorkerDiedError,
        CollectiveTimeoutError or WorkerGroupError. After anything that leaves the workers out of
        step with each other (a death, a hung collective, an error on some ranks while others
        still wait in a collective) the group is shut down first, so nothing stays blocked. An
        error every worker raised together (the engine's step outcome) leaves the group usable.
        ``lockstep``: the calls are one collective step, so a user error on some workers while
        others succeeded also leaves them out of step (one applied the step, one did not).
        ``independent``: the calls run no collective (a save), so after an error in one the others
        are waited for to the end, not suspected of waiting in a collective; only a death cuts short.
        """
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = dict(zip(refs, ranks))
        results: Dict[int, Any] = {}
        errors: Dict[int, BaseException] = {}
        pending = list(refs)
        first_error_at = None
        while pending:
            now = time.monotonic()
            grace = first_error_at is not None and (not independent or any(
                classify_error(e) is ErrorKind.DIED for e in errors.values()))
            if grace and now - first_error_at >= grace_s:
                break
            if deadline is not None and now >= deadline:
                break
            wait_s = 1.0 if deadline is None else min(1.0, deadline - now)
            if grace:
                wait_s = min(wait_s, grace_s - (now - first_error_at))
            done, pending = ray.wait(pending, num_returns=1, timeout=max(wait_s, 0.01))
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - analysed below
                    errors[rank_of[ref]] = error
                    if first_error_at is None:
                        first_error_at = time.monotonic()
        if not errors and not pending:
            return [results[r] for r in ranks]
        self._fail(errors, [rank_of[r] for r in pending], what, sorted(results) if lockstep else [],
                   answered=sorted(results))
        raise AssertionError("unreachable")

    def _fail(self, errors: Dict[int, BaseException], pending: List[int], what: str,
              succeeded: Sequence[int] = (), answered: Sequence[int] = ()) -> None:
        """Raise the error that explains a failed wait_all; see [Note: failure detection].
        ``answered``: the ranks whose call returned a result (kept as survivors with the ranks
        that raised, when the group keeps survivors: [Note: replace, don't restart])."""
        kinds = {rank: classify_error(e) for rank, e in errors.items()}
        dead = sorted(r for r, k in kinds.items() if k is ErrorKind.DIED)
        alive = sorted((set(errors) | set(answered)) - set(dead))
        if dead:
            cause = errors[dead[0]]
            message = (f"{what}: worker(s) {self._describe(dead)} died: {first_line(cause)}. " + (
                "The other workers were kept: fit replaces the lost one(s) and resumes from the in-memory snapshot"
                if self.keep_survivors and alive else
                "The worker group was shut down; fit restarts from the last checkpoint when "
                "FailureConfig(max_failures) allows it"))
            self._tear_down(message, alive)
            raise WorkerDiedError(message, dead, cause) from cause
        users = sorted(r for r, k in kinds.items() if k in (ErrorKind.USER, ErrorKind.PEER_STEP))
        if users:
            # The failing worker's own error; the others' PeerStepErrors only say that it failed.
            own = [r for r in users if kinds[r] is ErrorKind.USER] or users
            error = worker_error(errors[own[0]], f"worker {self._describe(own[:1])[1:-1]} during {what}")
            stuck = sorted(set(pending) | (set(errors) - set(users)))
            if stuck or succeeded:  # they wait (or timed out waiting) in a collective, or went on without them
                message = (f"worker(s) {own} raised during {what} while worker(s) {stuck} waited in a collective"
                           if stuck else f"worker(s) {own} raised during {what} while worker(s) {list(succeeded)} "
                           "completed it")
                self._tear_down(message)
                error.add_note(f"zeroray: {message}, so the worker group was shut down: build a new Trainer "
                               "or zr.Trainer.restore(...) from a checkpoint")
            raise error
        broken = sorted(errors)  # every error is a broken connection or a timed-out collective
        late = self._late_ranks(pending)
        timed_out = [r for r in broken if kinds[r] is ErrorKind.TIMEOUT]
        cause = errors[broken[0]] if broken else None
        if timed_out and all(isinstance(getattr(errors[r], "cause", errors[r]), RendezvousError) for r in timed_out):
            message = (f"{what}: the rendezvous did not complete within rendezvous_timeout_s="
                       f"{self.rendezvous_timeout_s:g} s on worker(s) {self._describe(timed_out)}, and no worker died "
                       "([Note: rendezvous timeout]): a loaded machine; "
                       + (f"worker(s) {self._describe(late)} did not answer and are replaced; " if late else "")
                       + ("the others were kept, the re-form is tried again" if self.keep_survivors else
                          "the worker group was shut down"))
            self._tear_down(message, sorted(set(alive) - set(late)))
            raise CollectiveTimeoutError(message, late, cause) from cause
        if timed_out or not errors:  # not errors: nothing came back before the driver's deadline
            waited = f"; worker(s) {self._describe(timed_out)} waited for them and timed out" if timed_out else ""
            message = (f"{what}: a collective did not complete within collective_timeout_s="
                       f"{self.collective_timeout_s:g} s: worker(s) {self._describe(late) if late else '(unknown)'} "
                       f"did not arrive{waited}. Every worker must run the same forward/backward (same modules, "
                       "same number of micro-batches); if one is just slow (data loading, a long first step), "
                       "raise ZeroConfig(collective_timeout_s=...). The worker group was shut down")
            self._tear_down(message, sorted(set(alive) - set(late)))
            raise CollectiveTimeoutError(message, late, cause) from cause
        message = (f"{what}: worker(s) {self._describe(broken)} lost the connection to a peer "
                   f"({first_line(cause)}); worker(s) {self._describe(late) if late else '(unknown)'} "
                   "probably died or became unreachable. The worker group was shut down")
        self._tear_down(message, sorted(set(alive) - set(late)))
        raise WorkerGroupError(message, late, cause) from cause

    def _late_ranks(self, pending: List[int]) -> List[int]:
        """Ranks that did not reach the collective the others are in: fewest collectives issued this step."""
        refs = {}
        for rank, actor in enumerate(self.actors):
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

    def _describe(self, ranks: Sequence[int]) -> str:
        where = []
        for r in ranks:
            node = self.nodes[r] if r < len(self.nodes) else None
            where.append(f"{r} (pid {node.pid} on {node.ip})" if node else str(r))
        return "[" + ", ".join(where) + "]"

    def _tear_down(self, reason: str, alive: Sequence[int] = ()) -> None:
        """Mark the group failed and kill its workers; with ``keep_survivors``, the ``alive`` ones
        (their call came back) stay for ``replace`` ([Note: replace, don't restart])."""
        self.failed = reason
        if self.keep_survivors and alive:
            log.warning("zeroray: %s; keeping worker(s) %s, replacing the others", reason, list(alive))
            self.survivors = list(alive)
            for rank, actor in enumerate(self.actors):
                if rank not in self.survivors:
                    kill(actor)
            return
        log.warning("zeroray: %s; shutting the worker group down", reason)
        self.shutdown()
