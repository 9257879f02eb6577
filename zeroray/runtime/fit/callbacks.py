"""``Trainer.fit(callbacks=[...])`` and ``Trainer.evaluate(callbacks=[...])``: code of the user's (or
of zeroray.tune's, or a tracker of zeroray.tracking's) that zeroray calls on the driver as events come.

The events, each one method of ``Callback``, reach the callbacks through ``Callbacks.emit`` (the
dispatcher below): fit's from fit/loop.py and from the step pipeline's ``run``
(execution/pipeline.py), a standalone evaluate's from trainer.py:
- ``on_fit_start(step)``: fit begins at step count ``step`` (nothing sent yet).
- ``on_checkpoint(step, path)``: fit saved a checkpoint (``CheckpointConfig(every_steps=...)``,
  or the save a failure interrupted, redone after recovery) of step ``step`` to ``path``.
- ``on_evaluation(step, metrics)``: an evaluation finished, of the weights at step count
  ``step``: fit's (``eval_every``, and the one at its end) or a standalone ``Trainer.evaluate``
  given the callbacks; ``metrics`` is evaluate's dict (``{"loss": ..., **metric_fn's}``).
- ``on_step(result)``: one step's ``StepResult``, after its checkpoint and evaluation
  (``result.evaluation`` holds that evaluation's metrics).
- ``on_recovery(record)``: fit recovered from a worker failure; ``record`` is a dict of the
  one ``trainer.recoveries`` just got (cause, step resumed at, timings). The steps after
  ``record["step"]`` come again (``on_step`` sees their step numbers repeat).
- ``on_fit_end(step, error)``: fit ends at step count ``step``; ``error`` is the exception it
  raises, or None. Called once for every ``on_fit_start``, even when fit fails.

Callbacks run on the driver only, on the thread that called fit or evaluate: the workers never
see them (nothing is logged from more than one process), and the layers keep it so (runtime/
imports no tracker).

Within fit, events come in step order. Steps are pipelined ([Note: pipelined steps] in
fit/loop.py): while ``on_step`` runs for step N, step N+1 may already be running on the
workers, which is what lets a slow callback (a report to Ray Tune waits for Tune's controller)
overlap training. A callback that must see the workers at exactly step N (to save a checkpoint
there, as zeroray.tune does) says so with ``pauses_after(N)``: fit then sends nothing behind
step N until ``on_step`` returned, as it does for its own checkpoints. An exception raised by a
callback ends fit as one raised by the data would (the steps already sent are collected first);
it is not a worker failure and is never retried. One raised by ``on_fit_end`` while fit is
already failing is logged, and fit's own error is the one raised.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence

from zeroray.runtime.execution.step import StepResult

log = logging.getLogger("zeroray")


class Callback:
    """Override what you need; the defaults do nothing."""

    def pauses_after(self, step: int) -> bool:
        """Whether fit must collect the step that ends at step count ``step`` and send no step
        behind it until ``on_step`` for it returned (so that ``on_step`` may save or evaluate)."""
        return False

    def on_fit_start(self, step: int) -> None:
        """fit begins at step count ``step``."""

    def on_step(self, result: StepResult) -> None:
        """One step's result, after its checkpoint and evaluation (``result.evaluation``)."""

    def on_evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        """An evaluation (fit's, or ``Trainer.evaluate``'s) of the weights at step count ``step``."""

    def on_checkpoint(self, step: int, path: Any) -> None:
        """fit saved the checkpoint of step ``step`` at ``path`` (its step directory)."""

    def on_recovery(self, record: Dict[str, Any]) -> None:
        """fit recovered from a worker failure; ``record`` is ``dict(trainer.recoveries[-1])``."""

    def on_fit_end(self, step: int, error: Optional[BaseException]) -> None:
        """fit ends at step count ``step``, raising ``error`` (None when it returns)."""


class Callbacks:
    """The reporters of one fit or evaluate, called in the order given: the progress bar first, when
    fit shows one (fit/progress.py), then the callbacks. ``emit`` is the one way runtime/ reaches
    them: an event goes to every reporter with an ``on_<event>`` method (the bar has
    ``on_collected``, which fit reports as soon as a step is collected, before its checkpoint, and
    ``on_fit_end``, where it closes)."""

    def __init__(self, callbacks: Sequence[Callback] = (), progress: Optional[Any] = None) -> None:
        self.callbacks = list(callbacks)
        if any(not isinstance(cb, Callback) for cb in self.callbacks):
            raise ValueError("callbacks must be zr.Callback objects (subclass zr.Callback and override its on_* "
                             f"methods), got {[type(cb).__name__ for cb in self.callbacks]}")
        self.reporters = ([progress] if progress is not None else []) + self.callbacks

    def pauses_after(self, step: int) -> bool:
        return any(cb.pauses_after(step) for cb in self.callbacks)

    def emit(self, event: str, *args: Any) -> None:
        """``on_<event>(*args)`` of every reporter that has it. ``evaluation`` and ``recovery`` give
        each a dict of its own (a callback's edit reaches no one else; a RecoveryRecord's details
        are mutable); ``fit_end`` reaches every reporter even after one raised (each may hold a run
        to close): the first error is raised then, unless fit is failing (its own error is what
        the user must see, and the callback's is logged)."""
        first: Optional[BaseException] = None
        for reporter in self.reporters:
            method = getattr(reporter, f"on_{event}", None)
            if method is None:
                continue
            call_args = (args[0], dict(args[1])) if event == "evaluation" else (
                (dict(args[0]),) if event == "recovery" else args)
            if event != "fit_end":
                method(*call_args)
                continue
            try:
                method(*call_args)
            except Exception as raised:  # noqa: BLE001 - the others still end; see above
                if args[1] is not None:
                    log.error("zeroray: %s.on_fit_end raised while fit was failing", type(reporter).__name__,
                              exc_info=raised)
                elif first is None:
                    first = raised
        if first is not None:
            raise first

    def fit_end(self, step: int, error: Optional[BaseException]) -> None:
        """Every callback's ``on_fit_end``, even after one raised: see ``emit``."""
        self.emit("fit_end", step, error)
