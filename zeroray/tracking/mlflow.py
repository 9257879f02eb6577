"""``MLflowCallback``: fit's and evaluate's scalars as one MLflow run (needs the ``mlflow``
package: the ``mlflow`` extra).

It logs through an ``MlflowClient`` of its own (not ``mlflow.start_run``'s process-wide active
run), so two trackers, or the user's own MLflow calls, do not step on each other. Read the run
back with ``MlflowClient(tracker.tracking_uri).get_metric_history(tracker.run_id, "train/loss")``,
or see it with ``mlflow ui --backend-store-uri <tracking_uri>``.

A local directory is tracked as MLflow recommends for one machine, a SQLite database in it
(``<dir>/mlflow.db``, artifacts under ``<dir>/artifacts``): MLflow 3 refuses its older file
store (``./mlruns``) unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set, and that store gets no
further updates.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from zeroray.tracking.scalars import Tracker, require


class MLflowCallback(Tracker):
    """Logs to a run of experiment ``experiment`` (made if missing) at ``tracking_uri``: a local
    directory (made if missing; see above) or any MLflow tracking URI (``sqlite:///...``,
    ``http://...``, ``file:///...``). The run starts when the first value comes; ``run_id`` names it; ``close()``
    marks it finished. ``params``: logged as the run's parameters (hyperparameters, say)."""

    def __init__(self, tracking_uri: Any, experiment: str = "zeroray", run_name: Optional[str] = None,
                 params: Optional[Dict[str, Any]] = None) -> None:
        tracking = require("mlflow.tracking", "mlflow", "MLflowCallback")
        text = os.fspath(tracking_uri)
        self.artifact_location: Optional[str] = None  # the server's default, for a URI
        if "://" not in text:
            local = Path(text).resolve()
            local.mkdir(parents=True, exist_ok=True)
            self.tracking_uri = f"sqlite:///{local / 'mlflow.db'}"
            self.artifact_location = (local / "artifacts").as_uri()
        else:
            self.tracking_uri = text
        self.experiment, self.run_name, self.params = experiment, run_name, dict(params or {})
        self.client = tracking.MlflowClient(self.tracking_uri)
        self.run_id: Optional[str] = None

    def _open(self) -> str:
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (found.experiment_id if found is not None else
                             self.client.create_experiment(self.experiment, artifact_location=self.artifact_location))
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
            for key, value in self.params.items():
                self.client.log_param(self.run_id, key, value)
        return self.run_id

    def log_scalars(self, step: int, values: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        run_id = self._open()
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
