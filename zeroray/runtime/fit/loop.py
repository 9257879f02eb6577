"""The fit loop: keep the next step in flight, checkpoint on a cadence, recover from worker failures.

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
  callback's ``pauses_after`` step (fit/callbacks.py).
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

import logging
from typing import Any, List, Optional

from zeroray.config import CheckpointConfig, FailureConfig
from zeroray.runtime.controller.controller import Controller
from zeroray.runtime.fit.callbacks import Callbacks
from zeroray.runtime.fit.data import Feed, feed_for, replayable
from zeroray.runtime.fit.evaluation import FitEvaluation
from zeroray.runtime.fit.progress import Progress
from zeroray.runtime.execution.step import StepResult

log = logging.getLogger("zeroray")

PIPELINE_DEPTH = 2  # steps in flight: the one running and the one queued behind it


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
    controller.begin_fit(skip, failure)
    error: Optional[BaseException] = None
    try:
        callbacks.fit_start(controller.step_count)
        end = None if num_steps is None else controller.data_position + num_steps
        feed = feed_for(controller, data, batch_size)  # checks a Dataset's batch_size before any step
        bar = Progress(num_steps, metrics_path=metrics_path) if progress else None
        note = bar.note if bar else log.warning
        results: List[StepResult] = []
        resave = False
        try:
            while True:
                try:
                    if resave:  # the save a failure interrupted: recovery resumed at its step
                        resave = False
                        _save(controller, checkpoint, callbacks)
                    _run(controller, feed, end, checkpoint, results, bar, evaluation, callbacks)
                    if evaluation is not None:
                        evaluation.finish(controller, results, bar, callbacks)
                    break
                except Exception as failed:  # noqa: BLE001 - classified by recover: raise, or restart
                    feed.close()
                    controller.recover(failed, note)
                    callbacks.recovery(controller.recoveries[-1])
                    results[:] = [r for r in results if r.step <= controller.step_count]  # replayed below
                    # From an in-memory snapshot, recovery may resume exactly at a step whose save
                    # the failure interrupted (a worker died writing it): the loop would not save
                    # that step again, and a later recovery would find only an older checkpoint.
                    resave = (controller.step_count > 0 and _saves_after(controller.step_count, checkpoint)
                              and controller.last_checkpoint_step != controller.step_count)
                    feed = feed_for(controller, data, batch_size)
        finally:
            feed.close()
            if bar:
                bar.close()
        return results
    except BaseException as raised:
        error = raised
        raise
    finally:
        controller.end_fit()
        callbacks.fit_end(controller.step_count, error)  # the Trainer is idle again: on_fit_end may evaluate


def _run(controller: Controller, feed: Feed, end: Optional[int], ckpt: CheckpointConfig,
         results: List[StepResult], bar: Optional[Progress], evaluation: Optional[FitEvaluation],
         callbacks: Callbacks) -> None:
    """Steps from ``feed`` until it ends or ``end`` is reached, PIPELINE_DEPTH in flight in the
    controller's pipeline ([Note: one step pipeline] in execution/pipeline.py)."""
    pipeline = controller.pipeline
    ended = False
    try:
        while True:
            while not ended and len(pipeline) < PIPELINE_DEPTH:
                if end is not None and controller.data_position + len(pipeline) >= end:
                    break
                last = pipeline.last_number
                if last is not None and (_saves_after(last, ckpt) or (evaluation is not None and evaluation.due(last))
                                         or callbacks.pauses_after(last)):
                    break  # a checkpoint, evaluation or callback waits for its step: nothing may run before it
                ended = feed.send() is None
            if not len(pipeline):
                return
            tokens = pipeline.next_tokens
            result = pipeline.collect()  # a failed step discards the ones behind it, then raises
            if result is None:  # its split had run out: so had every step behind it (discarded)
                return
            results.append(result)  # the pipeline counted its batch: data_position moved on
            if bar:
                if tokens is not None:  # each step's own: batches may change shape between steps
                    bar.tokens_per_step = tokens
                bar.update(result)
            if _saves_after(result.step, ckpt):
                _save(controller, ckpt, callbacks)
            if evaluation is not None and evaluation.due(result.step):
                evaluation.run(controller, results, bar, callbacks)
            callbacks.step(result)
    except BaseException:
        # The driver's side failed (the data iterator, a save, Ctrl-C): the steps already sent
        # count, so step_count and data_position say what the workers applied.
        pipeline.settle(results)
        raise


def _save(controller: Controller, ckpt: CheckpointConfig, callbacks: Callbacks) -> None:
    """fit's checkpoint of the step it is at (every_steps, or the save a failure interrupted)."""
    path = controller.save(ckpt.path, ckpt.keep)
    callbacks.checkpoint(controller.step_count, path)


def _saves_after(step: int, ckpt: CheckpointConfig) -> bool:
    return bool(ckpt.every_steps) and step % ckpt.every_steps == 0
