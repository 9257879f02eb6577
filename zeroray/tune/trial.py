"""``zt.Trial``: what a trial's function gets, to build its Trainer in the trial's resources and
train it with reports to Tune.

``trial.trainer(...)`` builds a ``zr.Trainer`` in the trial's placement group ([Note: trial
placement] in trainable.py), or, when Tune hands the trial a checkpoint (a paused or failed trial
resuming, a PBT exploit), restores it with ``zr.Trainer.restore`` at the trial's worker count;
an optimizer given there replaces the checkpoint's hyperparameters where it changes them, while
the optimizer state still loads (PBT's mutated ``lr`` takes effect: [Note: restoring the
optimizer] in runtime/controller/optimizer_restore.py). ``trial.fit(...)`` trains
to ``total_steps`` with a ``TuneReport`` callback (report.py). ``close`` (called by the trainable
when the function returns, raises, or is stopped by Tune) shuts every Trainer it made down and
removes the staging directory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, List, Optional

import ray
from ray import tune

from zeroray.config import ScalingConfig
from zeroray.runtime.execution.step import StepResult
from zeroray.runtime.trainer import Trainer
from zeroray.tune.report import TuneReport
from zeroray.tune.staging import Staging, zeroray_path


def _worker_bundles(pg: Any) -> List[int]:
    """The trial's worker bundles: every bundle after the driver's ([Note: trial placement]).
    Tune leaves an empty driver bundle (driver_cpus=0) out of the placement group."""
    resources = tune.get_context().get_trial_resources()
    first = 0 if resources.head_bundle_is_empty else 1
    return list(range(first, pg.bundle_count))


class Trial:
    """One trial's resources, checkpoint and reporting; made by ``zt.trainable`` for each run of
    the trial's function."""

    def __init__(self, template: ScalingConfig, staging: Optional[str] = None) -> None:
        pg = ray.util.get_current_placement_group() if ray.is_initialized() else None  # never start a Ray here
        if pg is None:
            raise RuntimeError("zeroray.tune.Trial runs inside a Ray Tune trial: pass zt.trainable(train, scaling) "
                               "to tune.Tuner, which starts each trial in its placement group")
        bundles = _worker_bundles(pg)
        specs = [pg.bundle_specs[i] for i in bundles]
        if not specs or any(s != specs[0] for s in specs):
            raise ValueError(f"the trial's worker bundles {specs} must be one or more equal bundles (zt.trial_resources "
                             "makes them)")
        self.placement_group = pg
        self.trial_id = tune.get_context().get_trial_id()
        # What the bundles hold decides; the rest of the template reaches the Trainer.
        self.scaling = replace(template, num_workers=len(bundles), cpus_per_worker=specs[0].get("CPU", 0.0),
                               use_gpu=specs[0].get("GPU", 0) >= 1, placement_group=pg,
                               placement_bundles=tuple(bundles),
                               min_workers=min(template.min_workers or len(bundles), len(bundles)))
        self.checkpoint: Optional[tune.Checkpoint] = tune.get_checkpoint()
        self.restored_from: Optional[str] = None  # the Tune checkpoint the trial's Trainer continued from
        self._staging_root = staging
        self._staging: Optional[Staging] = None
        self._trainers: List[Trainer] = []

    @property
    def num_workers(self) -> int:
        return self.scaling.num_workers

    def trainer(self, model_fn: Callable, loss_fn: Callable, **kwargs: Any) -> Trainer:
        """A ``zr.Trainer`` (same arguments, but no ``scaling``: the trial's resources decide) in the
        trial's placement group; restored from the trial's Tune checkpoint when it has one."""
        if "scaling" in kwargs:
            raise ValueError("trial.trainer(...) takes no scaling=: the trial's workers are its resources; give "
                             "num_workers, cpus_per_worker and use_gpu to zt.trainable(train, zr.ScalingConfig(...))")
        if self.checkpoint is not None:
            path = zeroray_path(self.checkpoint)
            trainer = Trainer.restore(path, model_fn, loss_fn, scaling=self.scaling, **kwargs)
            self.restored_from = str(path)
        else:
            trainer = Trainer(model_fn, loss_fn, scaling=self.scaling, **kwargs)
        self._trainers.append(trainer)
        return trainer

    def fit(self, trainer: Trainer, data: Any, total_steps: Optional[int] = None, *, report_every: int = 1,
            checkpoint_every: Optional[int] = None, eval_data: Any = None, eval_every: Optional[int] = None,
            eval_metric_fn: Optional[Callable] = None, batch_size: Optional[int] = None,
            progress: bool = False) -> List[StepResult]:
        """``trainer.fit`` up to step ``total_steps`` of the whole trial (a trial restored at step k
        trains ``total_steps - k`` more, its data resuming where the checkpoint's run was; None:
        until the data ends), reporting to Tune as it goes (report.py): every ``report_every``-th
        step, every evaluation (``eval_data`` every ``eval_every`` steps and at the end, as
        ``Trainer.fit``) and a checkpoint every ``checkpoint_every`` steps and at the end (None: no
        checkpoints; PBT and resuming need them). Returns this fit's StepResults."""
        for name, value in (("report_every", report_every), ("checkpoint_every", checkpoint_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1" + (", or None" if name != "report_every" else ""))
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                        or total_steps < 0):
            raise ValueError(f"total_steps={total_steps!r} must be an int >= 0 (the trial's steps in all), or None")
        if trainer not in self._trainers:
            raise ValueError("trial.fit needs a Trainer made by trial.trainer(...) (in the trial's placement group)")
        num_steps = None if total_steps is None else max(0, total_steps - trainer.step_count)
        if self._staging is None:
            self._staging = Staging(self._staging_root, self.trial_id)
        report = TuneReport(trainer, self._staging, report_every, checkpoint_every,
                            about={"restored_from": self.restored_from, "placement_group": self.placement_group.id.hex()})
        results = trainer.fit(data, num_steps, batch_size=batch_size, progress=progress, eval_data=eval_data,
                              eval_every=eval_every, eval_metric_fn=eval_metric_fn, callbacks=[report])
        report.finish(results)
        return results

    def close(self) -> None:
        """Shut down every Trainer this trial made and remove its staging directory."""
        trainers, self._trainers = self._trainers, []
        for trainer in trainers:
            trainer.shutdown()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
