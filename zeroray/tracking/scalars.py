"""What every tracker logs, and the base class that turns zeroray's events into it.

Each step logs, at x = its step number (``StepResult.step``, optimizer steps taken):
``train/loss``, ``train/grad_norm``, ``train/step_time_s`` and, under fp16, ``train/loss_scale``.
Each evaluation (fit's ``eval_every`` and the one at its end, or a ``Trainer.evaluate`` given the
tracker) logs ``eval/loss`` and ``eval/<metric>`` for every metric of ``eval_metric_fn``, at the
step count whose weights it evaluated. The names follow Hugging Face Trainer's ``train/`` and
``eval/`` prefixes, so the dashboards group them the same way. Values are logged as Python floats,
exactly as the StepResult and evaluate hold them (TensorBoard stores the nearest float32:
tracking/tensorboard.py).

After a recovery from a worker failure fit replays the steps after the checkpoint it resumed
from, and ``on_step`` sees their numbers again: TensorBoard keeps the later points (its reader drops
the orphaned ones), MLflow keeps both in the metric's history, and W&B, whose steps only go
forward, keeps the first (tracking/wandb.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict, Optional

from zeroray.runtime.fit.callbacks import Callback
from zeroray.runtime.execution.step import StepResult


def step_scalars(result: StepResult) -> Dict[str, float]:
    """A step's figures under their tracker names."""
    out = {"train/loss": float(result.loss), "train/grad_norm": float(result.grad_norm),
           "train/step_time_s": float(result.step_time_s)}
    if result.loss_scale is not None:
        out["train/loss_scale"] = float(result.loss_scale)
    return out


def eval_scalars(metrics: Dict[str, float]) -> Dict[str, float]:
    """An evaluation's ``{"loss": ..., **metrics}`` under their tracker names."""
    return {f"eval/{name}": float(value) for name, value in metrics.items()}


def require(module: str, extra: str, who: str) -> ModuleType:
    """``module``, imported now (a tracker's package is imported only when the tracker is built),
    or an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{who} needs the '{module.split('.')[0]}' package, which is not installed here: "
                          f"pip install 'zeroray[{extra}]'") from error


class Tracker(Callback):
    """A callback that logs every step's and evaluation's scalars (see above) to one run.

    A tracker stays open across fits and evaluates (a second fit goes on in the same run) and
    flushes when each fit ends; ``close()`` ends its run (or use it as a context manager).
    Subclasses implement ``log_scalars``, and ``flush`` and ``close`` where their run needs it.
    """

    def on_step(self, result: StepResult) -> None:
        self.log_scalars(result.step, step_scalars(result))

    def on_evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        self.log_scalars(step, eval_scalars(metrics))

    def on_fit_end(self, step: int, error: Optional[BaseException]) -> None:
        self.flush()

    def log_scalars(self, step: int, values: Dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged readable by the tracker's own reader."""

    def close(self) -> None:
        """End the run; nothing more is logged to it."""

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
