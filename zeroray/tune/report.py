"""The fit callback that reports a trial's steps to Ray Tune as they come, with checkpoints.

Each reported step is one ``tune.report`` (one Tune ``training_iteration``): ``step``, ``loss``,
``grad_norm``, ``skipped``, ``num_workers``, the evaluation that followed the step if one did
(``eval_loss``, ``eval_<metric>``, as in fit's metrics file) and what the trial knows about itself
(``restored_from``, ``placement_group``). Schedulers should count time in ``step``
(``ASHAScheduler(time_attr="step")``, ``PopulationBasedTraining(time_attr="step")``): it is the
Trainer's own step count, which a trial restored from a checkpoint continues, where
``training_iteration`` counts reports.

``tune.report`` blocks until Tune's controller has taken the result, and that is where Tune
stops a trial (ASHA) or pauses it (PBT): the report raises ``SystemExit`` in the trial's thread,
fit collects the step in flight and ends, and the trial shuts its Trainer down (trainable.py).
A report without a checkpoint runs while the next step already runs on the workers; one with
a checkpoint is a step fit pauses after (``pauses_after``), so the checkpoint holds exactly
that step ([Note: Tune checkpoints] in staging.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ray import tune

from zeroray.runtime.fit.callbacks import Callback
from zeroray.runtime.execution.step import StepResult
from zeroray.tune.staging import Staging


def step_metrics(result: StepResult) -> Dict[str, Any]:
    """What Tune gets of one step: its numbers and the evaluation that followed it."""
    metrics: Dict[str, Any] = {"step": result.step, "loss": result.loss, "grad_norm": result.grad_norm,
                               "skipped": result.skipped}
    for name, value in (result.evaluation or {}).items():
        metrics[f"eval_{name}"] = value
    return metrics


class TuneReport(Callback):
    """Report every ``report_every``-th step (and every step with a checkpoint or an evaluation);
    save a checkpoint every ``checkpoint_every`` steps (None: never). ``about`` is added to every
    report (what the trial says about itself)."""

    def __init__(self, trainer: Any, staging: Staging, report_every: int, checkpoint_every: Optional[int],
                 about: Dict[str, Any]) -> None:
        self.trainer, self.staging, self.about = trainer, staging, about
        self.report_every, self.checkpoint_every = report_every, checkpoint_every
        self.reported_step = -1                    # the last step reported (a replay after a recovery repeats steps)
        self.reported_evaluation = False           # whether that report carried an evaluation
        self.saved_step: Optional[int] = trainer.step_count if checkpoint_every else None  # restored: on Tune already

    def pauses_after(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0

    def on_step(self, result: StepResult) -> None:
        if result.step <= self.reported_step:
            return  # replayed after a recovery: Tune has it
        if result.step % self.report_every == 0 or result.evaluation is not None or self.pauses_after(result.step):
            self.report(result, save=self.pauses_after(result.step))

    def _check_placement(self) -> None:
        """Every worker runs in the trial's placement group ([Note: trial placement] in trainable.py)."""
        own = self.about["placement_group"]
        found = {w["rank"]: w["placement_group_id"] for w in self.trainer.workers}
        assert all(pg == own for pg in found.values()), f"workers outside the trial's placement group {own}: {found}"

    def finish(self, results: List[StepResult]) -> None:
        """After fit: the last step, if it was not reported or its evaluation (fit's last) came
        after its report, with a checkpoint if the trial checkpoints and that step has none."""
        if not results:
            return
        last = results[-1]
        unsaved = bool(self.checkpoint_every) and self.saved_step != last.step
        if last.step > self.reported_step or (last.evaluation is not None and not self.reported_evaluation) or unsaved:
            self.report(last, save=unsaved)

    def report(self, result: StepResult, save: bool) -> None:
        if self.reported_step < 0:
            self._check_placement()
        metrics = {**step_metrics(result), "num_workers": self.trainer.num_workers, **self.about}
        step_dir = self.staging.save(self.trainer) if save else None
        self.reported_step, self.reported_evaluation = result.step, result.evaluation is not None
        if step_dir is None:
            tune.report(metrics)
            return
        self.saved_step = result.step
        try:
            tune.report(metrics, checkpoint=self.staging.checkpoint(step_dir))  # copied before it returns
        finally:
            self.staging.drop(step_dir)
