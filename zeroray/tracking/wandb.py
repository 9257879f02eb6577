"""``WandbCallback``: fit's and evaluate's scalars as one Weights & Biases run, offline by
default (needs the ``wandb`` package: the ``wandb`` extra).

Offline, the run is written under ``<dir>/wandb/offline-run-*`` and nothing leaves the machine
(no account or API key needed); ``wandb sync <that directory>`` uploads it later. ``mode="online"``
logs as it goes, as ``wandb.init`` does.

W&B's x axis only goes forward: a value logged at a step below one already logged is dropped
(with a warning of W&B's). After a recovery fit replays the steps since its checkpoint, so this
tracker logs no value at a step at or below the one it last logged that value at, and the run keeps
each step's first values (the replayed steps redo the same batches from the same state).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from zeroray.tracking.scalars import Tracker, require


class WandbCallback(Tracker):
    """Logs to a W&B run made by ``wandb.init(project=..., dir=..., mode=..., name=..., config=...)``
    when the first value comes; ``run`` is it, ``close()`` finishes it. ``init_kwargs``: more
    arguments for ``wandb.init`` (``entity``, ``tags``, ``group``, ...)."""

    def __init__(self, dir: Any, project: str = "zeroray", mode: str = "offline", name: Optional[str] = None,
                 config: Optional[Dict[str, Any]] = None, **init_kwargs: Any) -> None:
        self._wandb = require("wandb", "wandb", "WandbCallback")
        self.dir = os.fspath(dir)
        self.init_kwargs = dict(project=project, mode=mode, name=name, config=dict(config or {}), **init_kwargs)
        self.run: Optional[Any] = None
        self._last_step = -1                 # the highest step logged
        self._logged: Dict[str, int] = {}    # per name, the step of its last value

    def _open(self) -> Any:
        if self.run is None:
            os.makedirs(self.dir, exist_ok=True)
            # create_new: a second tracker (or the user's own run) in this process is a run of its own
            self.run = self._wandb.init(dir=self.dir, reinit="create_new", **self.init_kwargs)
        return self.run

    def log_scalars(self, step: int, values: Dict[str, float]) -> None:
        run = self._open()
        # a replayed step after a recovery (see the module's docstring): W&B would drop it below its
        # current step, and let it overwrite the first values at its current step
        fresh = {name: value for name, value in values.items() if step > self._logged.get(name, -1)}
        if step < self._last_step or not fresh:
            return
        self._last_step = step
        self._logged.update((name, step) for name in fresh)
        run.log(fresh, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
