"""``Trainer.fit(callbacks=[...])``: code of the user's (or zeroray.tune's) that fit calls on the
driver as its steps come in.

A callback sees each step's ``StepResult`` once the step's checkpoint (``CheckpointConfig``)
and evaluation (``eval_every``) are done, in step order, on the thread that runs fit. Steps
are pipelined ([Note: pipelined steps] in fit_loop.py): while ``on_step`` runs for step N,
step N+1 may already be running on the workers, which is what lets a slow callback (a report
to Ray Tune waits for Tune's controller) overlap training. A callback that must see the
workers at exactly step N (to save a checkpoint there, as zeroray.tune does) says so with
``pauses_after(N)``: fit then sends nothing behind step N until ``on_step`` returned, as it
does for its own checkpoints. After fit recovered from a worker failure, the steps it replays
come again (their step numbers repeat). An exception raised by a callback ends fit as one raised
by the data would (the steps already sent are collected first); it is not a worker failure and
is never retried.
"""
from __future__ import annotations

from zeroray.runtime.step import StepResult


class Callback:
    """Override what you need; the defaults do nothing."""

    def pauses_after(self, step: int) -> bool:
        """Whether fit must collect the step that ends at step count ``step`` and send no step
        behind it until ``on_step`` for it returned (so that ``on_step`` may save or evaluate)."""
        return False

    def on_step(self, result: StepResult) -> None:
        """One step's result, after its checkpoint and evaluation (``result.evaluation``)."""
