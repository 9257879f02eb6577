"""fit's entry: ``run_fit`` checks fit's arguments, builds its plan and hands it to the controller.

The plan (execution/pipeline.py's ``FitPlan``) is the fit as data: its feed (fit/data.py), where
it starts and stops in the data, its checkpoint, evaluation and callback cadence, the save to
call, the one ``report`` to the progress bar and the callbacks, and its FailureConfig.
``Controller.fit`` (controller/controller.py) brackets the fit in one place: FITTING, the step
pipeline's runs of its steps (``StepPipeline.run``, which keeps steps in flight as below) with a
recovery between two where a worker failed, and IDLE again.

[Note: pipelined steps]
While step N runs on the workers, the driver has already sent step N+1 (its call and, for a
list of batches, its batch): when N ends, N+1 starts at once, and the driver's own work (the
next batch, splitting it, progress and metrics) and Ray's dispatch hide behind compute. The
meaning of fit does not change:
- N+1 is sent with ``after_ok``: if N fails, N+1 does not run on any worker (it returns
  ``Cancelled``, see worker/sequencer.py) or its group is gone; the pipeline discards it and
  handles N's error alone.
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
    start = controller.position.data_position if skip is None else skip
    # The progress bar is the first reporter: it closes on fit_end, before the callbacks hear of it.
    bar = Progress(num_steps, metrics_path=metrics_path) if progress else None
    reporters = Callbacks(callbacks.callbacks, progress=bar) if bar else callbacks
    plan = FitPlan(feed=functools.partial(feed_for, data=data, batch_size=batch_size), report=reporters.emit,
                   note=bar.note if bar else log.warning, failure=failure, start=start,
                   end=None if num_steps is None else start + num_steps, save_every=checkpoint.every_steps,
                   save=functools.partial(controller.checkpoints.save, checkpoint.path, checkpoint.keep),
                   evaluation=evaluation, pauses_after=callbacks.pauses_after if callbacks.callbacks else None)
    try:
        return controller.fit(plan)
    finally:
        if bar:
            bar.close()  # closed already, unless the Trainer refused the fit (it was busy)
