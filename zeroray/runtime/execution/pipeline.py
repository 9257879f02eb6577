"""The one step pipeline: the steps in flight, from sent to collected, and what goes with them.

[Note: one step pipeline]
Every step the driver sends goes through ``StepPipeline``: ``Controller.step`` (one step, sent
and collected), fit's steps (two in flight, [Note: pipelined steps] in fit/loop.py), and the
Ray Data feed (a "train on your next batch" step, fit/data.py). It owns the steps in flight (the
only count of them is its queue), and their order: ``send`` / ``send_local`` number a step
behind the last one sent (``after_ok`` behind another, so that a step queued behind a failed
one is cancelled, see worker/sequencer.py); ``collect`` waits for the oldest; when a step fails or
its Ray Data split has run out, the steps behind it are discarded; ``settle`` collects what is
still in flight when the driver's side is interrupted, so the counts say what the workers
applied. The snapshot taken right behind a step of fit's ([Note: in-memory snapshots] in
snapshot.py) is sent with it and completed when it is collected. Evaluation batches go through
it too, two in flight as steps, never beside a step.

fit's steps are ``run``: the Controller's ``fit`` hands it a ``FitPlan``, the fit as data (its
feed, where it starts and stops, which steps a checkpoint, an evaluation or a callback waits
for, the save to call, and the one ``report`` through which the progress bar and the callbacks
hear of each event), so a fit's steps are read in one place, top to bottom. Whether a step is
fit's is said when it is sent (``fit=True``, which ``run`` sends): it is what consumes a batch of
fit's data and has a snapshot behind it; the pipeline never asks what the trainer is doing
(that is the Controller's state, which only it consults).

What a collected step changes is written to the ``Position`` (the step count and the data
position): by ``collect`` for a step, and by the controller for a load or a recovery, always
through ``Position``'s methods.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import ray
import torch

from zeroray.config import FailureConfig, ZeroConfig
from zeroray.engine.batch import batch_size, split_batch
from zeroray.runtime.batch_transport import PackedBatch
from zeroray.runtime.data_source import is_ray_dataset
from zeroray.runtime.records import SplitInfo, StepRecord
from zeroray.runtime.worker.sequencer import Cancelled
from zeroray.runtime.snapshot import Snapshot
from zeroray.runtime.execution.step import StepResult
from zeroray.runtime.trainer_state import SHUT_DOWN
from zeroray.runtime.worker_group.group import WorkerGroup


class GroupSlot:
    """The one live WorkerGroup of a trainer; what the trainer's finalizer releases."""

    def __init__(self) -> None:
        self.group: Optional[WorkerGroup] = None

    def get(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError(SHUT_DOWN)
        return self.group

    def release(self) -> None:
        group, self.group = self.group, None
        # Ray down (its atexit hook ran): calling into it would start a new local Ray ([Note:
        # releasing at exit] in trainer.py); the actors went with the cluster or with their owner.
        if group is not None and ray.is_initialized():
            group.shutdown()


class Position:
    """How far training is: ``step_count`` (optimizer steps applied) and ``data_position`` (global
    batches consumed from fit's data, [Note: data replay] in fit/loop.py). Written only through
    its methods: ``advance`` as a step is collected, ``set`` for a load, a recovery or a seek."""

    def __init__(self) -> None:
        self.step_count = 0
        self.data_position = 0

    def advance(self, step: int, consumed: bool) -> None:
        """A collected step: the step count it ends at; ``consumed``: it took one of fit's batches."""
        self.step_count = step
        self.data_position += int(consumed)

    def set(self, step_count: Optional[int] = None, data_position: Optional[int] = None) -> None:
        if step_count is not None:
            self.step_count = step_count
        if data_position is not None:
            self.data_position = data_position


PIPELINE_DEPTH = 2  # fit's steps in flight: the one running and the one queued behind it


class SnapshotKeeper:
    """The complete in-memory snapshot of a fit, if any; see [Note: in-memory snapshots] in snapshot.py."""

    def __init__(self, every: Optional[int]) -> None:
        self.every = every
        self.complete: Optional[Snapshot] = None

    def due(self, step: int) -> bool:
        """Whether the step that ends at step count ``step`` is followed by a snapshot."""
        return _due(step, self.every)

    def promote(self, snapshot: Snapshot, step: int, data_position: int) -> None:
        """``snapshot`` (its records were waited for) is the complete one; the one before is released."""
        snapshot.step, snapshot.data_position = step, data_position
        self.complete = snapshot  # the old one's refs go with it: Ray frees its objects

    def drop(self) -> None:
        self.complete = None


@dataclass
class PendingStep:
    """A step sent to every worker whose results were not collected yet (``StepPipeline.collect``).

    ``refs``: one object ref per worker, rank order. ``tokens``: elements of the largest tensor
    of the global batch (progress's tokens/s), when known.
    """

    refs: List[Any]
    submitted_at: float
    number: int                  # the step count this step ends at, if it runs
    tokens: Optional[int] = None
    fit: bool = False  # one of fit's steps: it consumes a global batch of fit's data ([Note: data replay])
    snapshot: Optional[Snapshot] = None  # fit: the in-memory snapshot taken right behind it

    @staticmethod
    def combine(results: List[StepRecord]) -> StepResult:
        """The StepResult of the workers' per-rank records (rank order): the mean of their losses
        (each weighted by its rows), rank 0's global values, the slowest engine's time."""
        r0 = results[0].stats
        return StepResult(loss=sum(r.stats.loss for r in results) / len(results), grad_norm=r0.grad_norm,
                          step=r0.step, skipped=r0.skipped, loss_scale=r0.loss_scale,
                          step_time_s=max(r.stats.time_s for r in results))


@dataclass(frozen=True)
class Feed:
    """fit's source of steps (``FitPlan.feed``, fit/data.py's ``feed_for``): the driver's own global batches
    (``batches``), or, when ``batches`` is None, Ray Data splits attached to the workers as
    ``feed_id``, each worker stepping on its own split's next batch (``empty``: they hold none)."""

    batches: Optional[Iterator[Any]] = None
    feed_id: Optional[str] = None
    tokens: Optional[int] = None  # Ray Data: the tokens of one global batch, when known
    empty: bool = False


@dataclass(frozen=True)
class FitPlan:
    """One fit, as data: built by fit/loop.py, bracketed by ``Controller.fit``, its steps run by
    ``StepPipeline.run`` ([Note: pipelined steps] in fit/loop.py).

    ``feed(pipeline)`` opens fit's source of steps at the pipeline's data position (fit/data.py's
    ``feed_for``); ``report(event, *args)`` tells the progress bar and the callbacks (fit/callbacks.py's
    ``Callbacks.emit``), ``note(message)`` tells the user of a recovery; ``failure`` is the fit's
    FailureConfig (its snapshot cadence; what recovery acts on); ``save()`` writes the checkpoint
    of the step the trainer is at and returns its path; ``evaluation`` has fit's ``data``,
    ``every``, ``metric_fn`` and ``dataset_batch_size`` (fit/evaluation.py); ``pauses_after(step)``
    is a callback's wish to see the workers at ``step`` (None when fit has no callback to ask)."""

    feed: Callable[["StepPipeline"], Feed]
    report: Callable[..., None]
    note: Callable[[str], None]
    failure: FailureConfig
    start: int = 0  # the data position fit begins at
    end: Optional[int] = None  # the data position fit stops at; None: where the data ends
    save_every: Optional[int] = None
    save: Optional[Callable[[], Any]] = None
    evaluation: Optional[Any] = None
    pauses_after: Optional[Callable[[int], bool]] = None

    def saves_at(self, step: int) -> bool:
        """Whether fit writes a checkpoint of the step that ends at step count ``step``."""
        return self.save is not None and _due(step, self.save_every)


class StepPipeline:
    """The steps in flight on a trainer's group; see [Note: one step pipeline]."""

    def __init__(self, slot: GroupSlot, zero: ZeroConfig, position: Position) -> None:
        self.slot, self.zero, self.position = slot, zero, position
        self.in_flight: Deque[PendingStep] = deque()
        self.snapshots = SnapshotKeeper(None)  # fit: the newest in-memory snapshot ([Note: in-memory snapshots])
        self.evaluated_at: Optional[int] = None  # fit: the step count its last evaluation saw

    @contextlib.contextmanager
    def fitting(self, plan: FitPlan) -> Iterator[None]:
        """A fit's span on the pipeline (``Controller.fit``): its snapshot cadence and the data
        position it starts at; when it ends, also by an error, its snapshot is released (it serves
        this fit only)."""
        self.snapshots = SnapshotKeeper(plan.failure.snapshot_every)
        self.evaluated_at = None
        self.position.set(data_position=plan.start)
        try:
            yield
        finally:
            self.snapshots = SnapshotKeeper(None)

    def __len__(self) -> int:
        """Steps sent and not yet collected."""
        return len(self.in_flight)

    # --- send ------------------------------------------------------------------------------

    def send(self, batch: Any, *, tokens: Optional[int] = None, fit: bool = False) -> PendingStep:
        """Send one step on a global batch to every worker, without waiting for it; ``fit``: one of
        fit's steps (``run``'s)."""
        group = self.slot.get()
        rows = self._check_batch(batch, group.num_workers)
        shards = [PackedBatch(s) for s in split_batch(batch, group.num_workers)]  # [Note: batch transport]
        return self._sent(group.call("train_step", per_rank=[(s, rows) for s in shards], after_ok=bool(self.in_flight)),
                          tokens, fit)

    def send_local(self, *, tokens: Optional[int] = None) -> PendingStep:
        """Send one of fit's steps on every worker's next batch of its attached Ray Data split (fit/data.py)."""
        return self._sent(self.slot.get().call("train_next", after_ok=bool(self.in_flight)), tokens, fit=True)

    def attach(self, splits: Sequence[Any], local_batch: int, skip: int, feed_id: str) -> List[SplitInfo]:
        """Give worker ``r`` Ray Data split ``r`` to step on (``send_local``), ``skip`` local batches in."""
        group = self.slot.get()
        per_rank = [(split, local_batch, skip, feed_id) for split in splits]
        return group.wait_all(group.call("attach_data", per_rank=per_rank),
                              None, "attach the Ray Data splits")

    def detach(self, feed_id: str) -> None:
        """Best effort: the group the splits were attached to may be gone already."""
        try:
            self.slot.get().call("detach_data", feed_id)
        except Exception:  # noqa: BLE001
            pass

    @property
    def num_workers(self) -> int:
        return self.slot.get().num_workers

    def _sent(self, refs: List[Any], tokens: Optional[int], fit: bool) -> PendingStep:
        number = self.position.step_count + len(self.in_flight) + 1
        pending = PendingStep(refs, time.time(), number, tokens, fit, snapshot=self._snapshot_after(number) if fit
                              else None)
        self.in_flight.append(pending)
        return pending

    def _check_batch(self, batch: Any, num_workers: int) -> int:
        """The global batch's rows: at least one per micro-batch of every worker ([Note: uneven
        splits] in engine/batch.py)."""
        size = batch_size(batch)
        parts = num_workers * self.zero.grad_accum_steps
        if size < parts:
            raise ValueError(
                f"the global batch has {size} rows, fewer than {num_workers} worker(s) x "
                f"{self.zero.grad_accum_steps} micro-batch(es): every micro-batch of every worker needs at least "
                f"one row; use a global batch of at least {parts} rows")
        return size

    def _snapshot_after(self, number: int) -> Optional[Snapshot]:
        """fit: the snapshot call numbered right behind the step that ends at ``number``, when one
        is due; see [Note: in-memory snapshots] in snapshot.py."""
        if not self.snapshots.due(number):
            return None
        group = self.slot.get()
        per_rank = group.call("snapshot_shard", after_ok=True, num_returns=3)
        return Snapshot(layout=group.setup_info[0].layout, shards=[r[0] for r in per_rank],
                        untrained=per_rank[0][1], records=[r[2] for r in per_rank])

    # --- collect ---------------------------------------------------------------------------

    def collect(self) -> Optional[StepResult]:
        """Wait for the oldest step in flight. Its StepResult; None when it did not run (its split
        had run out, or it was cancelled), and then neither do the steps behind it, which are
        discarded. Raises what the step raised (see worker_group.wait_all), after discarding the
        steps behind it (cancelled behind the failed one, or their group is gone)."""
        pending = self.in_flight.popleft()
        try:
            result = self._finish(pending)
        except BaseException:
            self.discard()
            raise
        if result is None:
            self.discard()
        return result

    def _finish(self, pending: PendingStep) -> Optional[StepResult]:
        group = self.slot.get()
        outs = group.wait_all(pending.refs, self.zero.collective_timeout_s + 60, f"step {pending.number - 1}",
                              lockstep=True)
        ran = [o is not None and not isinstance(o, Cancelled) for o in outs]
        if not any(ran):
            return None
        if not all(ran):  # equal=True splits and the step outcome make this impossible
            raise RuntimeError(f"step {pending.number - 1} ran on some workers only: {outs}")
        result = PendingStep.combine(outs)
        # a fit's step consumed one global batch ([Note: data replay])
        self.position.advance(result.step, consumed=pending.fit)
        if pending.snapshot is not None:  # its export ran right behind the step: wait for the small records
            records = group.wait_all(pending.snapshot.records, self.zero.collective_timeout_s + 60,
                                     f"snapshot of step {result.step}", independent=True)
            if any(r.step != result.step for r in records):
                raise RuntimeError(f"the snapshot behind step {result.step} holds steps "
                                   f"{[r.step for r in records]}: a zeroray bug")
            self.snapshots.promote(pending.snapshot, result.step, self.position.data_position)
            group.hold_copies(pending.snapshot.shards)  # [Note: buddy copies] in snapshot.py
        result.timeline = {"submit": pending.submitted_at, **dataclasses.asdict(outs[0].hops), "receive": time.time()}
        return result

    def discard(self, timeout_s: float = 10.0) -> None:
        """Forget the steps in flight (behind a failed one: they were cancelled, or their group is
        gone). Waits for them briefly, so none is still queued when the caller goes on."""
        pending, self.in_flight = list(self.in_flight), deque()
        wait_quietly([ref for p in pending for ref in p.refs], timeout_s)

    def forget(self) -> None:
        """Drop the steps in flight without waiting: their group is gone (a recovery, close)."""
        self.in_flight.clear()

    def settle(self, results: List[StepResult]) -> None:
        """Collect the steps still in flight when fit is interrupted (their results count); an
        error of theirs discards the rest: the interruption is what the caller sees."""
        while self.in_flight:
            try:
                result = self.collect()
            except BaseException:  # noqa: BLE001
                return
            if result is not None:
                results.append(result)

    # --- fit's steps ----------------------------------------------------------------------

    def run(self, plan: FitPlan, results: List[StepResult]) -> None:
        """fit's steps from the plan's feed (opened at the data position, closed when the run ends)
        until it ends or ``plan.end`` is reached, PIPELINE_DEPTH in flight ([Note: pipelined steps]
        in fit/loop.py), each collected one appended to ``results`` and reported; then fit's last
        evaluation, unless the last step's ran. Raises what a step raised (the Controller recovers,
        and runs it again from where recovery resumed)."""
        feed = plan.feed(self)  # a Ray Data feed attaches the workers' splits: detached below
        ended = False
        try:
            while True:
                while not ended and len(self.in_flight) < PIPELINE_DEPTH and not self._waits(plan):
                    ended = not self._send_from(feed)
                if not self.in_flight:
                    break
                tokens = self.in_flight[0].tokens  # each step's own: batches may change shape between steps
                result = self.collect()  # a failed step discards the ones behind it, then raises
                if result is None:  # its split had run out: so had every step behind it (discarded)
                    break
                results.append(result)  # collect counted its batch: data_position moved on
                self._after(result, tokens, plan, results)
            if plan.evaluation is not None and self.evaluated_at != self.position.step_count:
                self._evaluate_for_fit(plan, results)
        except BaseException:
            # The driver's side failed (the data iterator, a save, a callback, Ctrl-C): the steps
            # already sent count, so step_count and data_position say what the workers applied.
            self.settle(results)
            raise
        finally:
            if feed.feed_id is not None:
                self.detach(feed.feed_id)

    def _waits(self, plan: FitPlan) -> bool:
        """Whether nothing more may be sent now: fit's end is in flight, or the last step sent is
        one that a checkpoint, an evaluation or a callback waits for ([Note: pipelined steps])."""
        if plan.end is not None and self.position.data_position + len(self.in_flight) >= plan.end:
            return True
        if not self.in_flight:
            return False
        last = self.in_flight[-1].number
        return (plan.saves_at(last) or (plan.evaluation is not None and _due(last, plan.evaluation.every))
                or (plan.pauses_after is not None and plan.pauses_after(last)))

    def _send_from(self, feed: Feed) -> bool:
        """Send the feed's next step; False when it has none."""
        if feed.batches is None:  # Ray Data: every worker steps on its split's next batch
            if feed.empty:
                return False
            self.send_local(tokens=feed.tokens)
            return True
        for batch in feed.batches:
            self.send(batch, tokens=_tokens(batch), fit=True)
            return True
        return False

    def _after(self, result: StepResult, tokens: Optional[int], plan: FitPlan, results: List[StepResult]) -> None:
        """A collected step of fit's: the progress bar first, then its checkpoint and evaluation
        when due (nothing is in flight behind it then), then the callbacks' ``on_step``."""
        plan.report("collected", result, tokens)
        if plan.saves_at(result.step):
            plan.report("checkpoint", result.step, plan.save())
        if plan.evaluation is not None and _due(result.step, plan.evaluation.every):
            self._evaluate_for_fit(plan, results)
        plan.report("step", result)

    def _evaluate_for_fit(self, plan: FitPlan, results: List[StepResult]) -> None:
        """fit's evaluation (fit/evaluation.py) of the weights it is at, given to the step it followed."""
        ev = plan.evaluation
        metrics = self.evaluate(ev.data, ev.metric_fn, ev.dataset_batch_size)
        step = self.evaluated_at = self.position.step_count
        if results and results[-1].step == step:
            results[-1].evaluation = metrics
        plan.report("evaluation", step, metrics)

    # --- evaluation ([Note: inference calls] in engine/inference.py) ----------------------------

    def evaluate(self, data: Any, metric_fn: Optional[Callable], dataset_batch_size: Optional[int]
                 ) -> Dict[str, float]:
        """Every global batch split over the workers; per batch the mean over workers of what each
        reported, weighted by their rows (the plain mean when they are equal: [Note: uneven splits]
        in engine/batch.py), then the mean over batches. Two batches in flight, as fit keeps steps;
        never beside a step."""
        if self.in_flight:
            raise RuntimeError(f"evaluation runs between complete steps only ({len(self.in_flight)} step(s) in "
                               "flight): a zeroray bug")
        group = self.slot.get()
        n = group.num_workers
        metric_ref = ray.put(metric_fn)  # sent once, not with every batch
        sums: Dict[str, float] = {}
        counts: Dict[str, int] = {}
        pending: Deque[Tuple[int, List[int], List[Any]]] = deque()

        def collect(index: int, rows: List[int], refs: List[Any]) -> None:
            outs = group.wait_all(refs, None, f"evaluate (batch {index})")
            if any(set(o) != set(outs[0]) for o in outs):
                raise ValueError(f"evaluate: metric_fn returned other names on other workers for batch {index}: "
                                 f"{[sorted(o) for o in outs]}; return the same names on every worker")
            for key in outs[0]:
                if len(set(rows)) == 1:
                    value = sum(o[key] for o in outs) / n
                else:
                    value = sum(o[key] * r for o, r in zip(outs, rows)) / sum(rows)
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1

        try:
            for index, batch in enumerate(_evaluation_batches(data, dataset_batch_size)):
                size = batch_size(batch)
                if size < n:
                    raise ValueError(f"evaluate: batch {index} has {size} rows, fewer than the {n} workers: every "
                                     f"worker needs at least one row; use batches of at least {n} rows")
                parts = split_batch(batch, n)
                rows = [batch_size(p) for p in parts]
                shards = [PackedBatch(s) for s in parts]  # [Note: batch transport]
                pending.append((index, rows, group.call("evaluate", per_rank=[(s, metric_ref) for s in shards])))
                if len(pending) == 2:
                    collect(*pending.popleft())
            while pending:
                collect(*pending.popleft())
        except BaseException:
            wait_quietly([ref for _, _, refs in pending for ref in refs], 10.0)
            raise
        if not counts:
            raise ValueError("evaluate: the data held no batches")
        return {key: sums[key] / counts[key] for key in sums}


def _due(step: int, every: Optional[int]) -> bool:
    """Whether a cadence of ``every`` steps (None or 0: never) falls on step count ``step``."""
    return bool(every) and step % every == 0


def _tokens(batch: Any) -> Optional[int]:
    """Elements of the batch's first tensor (progress's tokens/s), when it has one."""
    first = batch[0] if isinstance(batch, (list, tuple)) else (
        next(iter(batch.values())) if isinstance(batch, Mapping) else batch)
    return int(first.numel()) if isinstance(first, torch.Tensor) else None


def _evaluation_batches(data: Any, dataset_batch_size: Optional[int]) -> Iterator[Any]:
    """The global batches of an evaluation's data: an iterable of them as it is, or a
    ``ray.data.Dataset`` read on the driver in dicts of ``dataset_batch_size`` rows (the last
    partial batch dropped, as fit drops it). Evaluation data is small next to training data, so
    it goes through the driver rather than through per-worker splits."""
    if is_ray_dataset(data):
        if not isinstance(dataset_batch_size, int) or isinstance(dataset_batch_size, bool) or dataset_batch_size < 1:
            raise ValueError("evaluate with a ray.data.Dataset needs batch_size= (the global batch size, in rows, "
                             f"split over the workers), got {dataset_batch_size!r}")
        return iter(data.iter_torch_batches(batch_size=dataset_batch_size, drop_last=True))
    if dataset_batch_size is not None:
        raise ValueError("evaluate: batch_size= is for a ray.data.Dataset; an iterable of global batches has the "
                         "sizes of its batches")
    try:
        return iter(data)
    except TypeError:
        raise ValueError("evaluate needs an iterable of global batches (a list of tensors or of tuples/dicts of "
                         f"tensors) or a ray.data.Dataset, got {type(data).__name__}") from None


def wait_quietly(refs: List[Any], timeout_s: float) -> None:
    """Wait briefly for calls whose outcome no longer matters (behind a failed one): none is
    still queued when the caller goes on; their errors were raised already, or are moot."""
    if refs:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001
                pass
