"""The fit loop: the step pipeline runs fit's steps on a plan; recover from worker failures.

``run_fit`` checks fit's arguments, begins the fit on the controller, builds the data feed
(fit/data.py) and the plan (where fit stops, its checkpoint, evaluation and callback cadence,
the one ``report`` to the progress bar and the callbacks), and hands both to the step
pipeline's ``run`` (execution/pipeline.py), which keeps steps in flight as below. On a worker
failure it asks the controller to recover, and runs the pipeline again on a fresh feed.

[Note: pipelined steps]
While step N runs on the workers, the driver has already sent step N+1 (its call and, for a
list of batches, its batch): when N ends, N+1 starts at once, and the driver's own work (the
next batch, splitting it, progress and metrics) and Ray's dispatch hide behind compute. The
meaning of fit does not change:
- N+1 is sent with ``after_ok``: if N fails, N+1 does not run on any worker (it returns
  ``Cancelled``, see worker/sequencer.py) or its group is gone; the loop discards it and handles N's
  error alone.
- A checkpoint waits for its step: when step N is one that saves (``every_steps``), N+1 is not
  sent until N's result is in and the save is done, so no queued step runs before the save.
  An evaluation (``eval_every``, fit/evaluation.py) waits for its step the same way, and so does a
  callback's ``pauses_after`` step (fit/callbacks.py): the plan holds the cadence as data, and
  the pipeline's ``run`` waits (``StepPipeline._waits``).
- Results and progress come in step order, one per step, as each step is collected.
- When fit leaves early (the data iterator raised, Ctrl-C), the step still in flight is
  collected first, so ``step_count`` and ``data_position`` count exactly the steps the
  workers applied.

[Note: data replay]
``data_position`` counts the global batches consumed from the data given to fit. A checkpoint
records it. After a failure the group is rebuilt, the last checkpoint loaded, and the data is
iterated again from its start with the first ``data_position`` batches skipped, so every step
sees the batch it would have seen without the failure. This needs a re-iterable source (a
list, a Dataset-like object with __iter__ returning a fresh iterator, or a ray.data.Dataset);
a one-shot iterator cannot be replayed and fit says so. With a one-shot iterator, a step that
fails may leave one more batch taken from it than ``data_position`` counts (the batch of the
step that was in flight behind it).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, List, Optional

from zeroray.config import CheckpointConfig, FailureConfig
from zeroray.runtime.controller.controller import Controller
from zeroray.runtime.execution.pipeline import FitPlan
from zeroray.runtime.execution.step import StepResult
from zeroray.runtime.fit.callbacks import Callbacks
from zeroray.runtime.fit.data import feed_for, replayable
from zeroray.runtime.fit.evaluation import FitEvaluation
from zeroray.runtime.fit.progress import Progress

log = logging.getLogger("zeroray")


def run_fit(controller: Controller, data: Any, num_steps: Optional[int], *, batch_size: Optional[int],
            skip: Optional[int], progress: bool, failure: FailureConfig, checkpoint: CheckpointConfig,
            metrics_path: Optional[str], evaluation: Optional[FitEvaluation] = None,
            callbacks: Optional[Callbacks] = None) -> List[StepResult]:
    """Trainer.fit: see its docstring, [Note: pipelined steps] and [Note: data replay]; the events
    reach ``callbacks`` as fit/callbacks.py says."""
    callbacks = callbacks or Callbacks()
    if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0):
        raise ValueError(f"num_steps={num_steps!r} must be an int >= 0, or None to run until the data ends")
    if failure.max_failures > 0 and not replayable(data):
        raise ValueError("fit with FailureConfig(max_failures>0) needs re-iterable data (a list, or an object "
                         "whose __iter__ starts over), so batches can be replayed after a failure; "
                         "got a one-shot iterator")
    start_step, start_position = controller.begin_fit(skip, failure)
    pipeline = controller.pipeline
    error: Optional[BaseException] = None
    try:
        callbacks.emit("fit_start", start_step)
        feed = feed_for(pipeline, data, batch_size)  # checks a Dataset's batch_size before any step
        bar = Progress(num_steps, metrics_path=metrics_path) if progress else None
        reporters = Callbacks(callbacks.callbacks, progress=bar) if bar else callbacks
        note = bar.note if bar else log.warning
        plan = FitPlan(report=reporters.emit, end=None if num_steps is None else start_position + num_steps,
                       save_every=checkpoint.every_steps,
                       save=functools.partial(controller.checkpoints.save, checkpoint.path, checkpoint.keep),
                       evaluation=evaluation, pauses_after=callbacks.pauses_after if callbacks.callbacks else None)
        results: List[StepResult] = []
        resave = False
        try:
            while True:
                try:
                    if resave:  # the save a failure interrupted: recovery resumed at its step
                        resave = False
                        reporters.emit("checkpoint", pipeline.position.step_count, plan.save())
                    pipeline.run(feed, plan, results)
                    break
                except Exception as failed:  # noqa: BLE001 - classified by recover: raise, or restart
                    if feed.feed_id is not None:
                        pipeline.detach(feed.feed_id)
                    controller.recover(failed, note)
                    step = pipeline.position.step_count
                    reporters.emit("recovery", controller.recovery.recoveries[-1])
                    results[:] = [r for r in results if r.step <= step]  # replayed below
                    # From an in-memory snapshot, recovery may resume exactly at a step whose save
                    # the failure interrupted (a worker died writing it): the loop would not save
                    # that step again, and a later recovery would find only an older checkpoint.
                    resave = (step > 0 and bool(checkpoint.every_steps) and step % checkpoint.every_steps == 0
                              and controller.last_checkpoint_step != step)
                    feed = feed_for(pipeline, data, batch_size)
        finally:
            if feed.feed_id is not None:
                pipeline.detach(feed.feed_id)
            if bar:
                bar.close()
        return results
    except BaseException as raised:
        error = raised
        raise
    finally:
        callbacks.emit("fit_end", controller.end_fit(), error)  # the Trainer is idle again: on_fit_end may evaluate
