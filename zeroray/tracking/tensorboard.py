"""``TensorBoardCallback``: fit's and evaluate's scalars as TensorBoard event files
(``torch.utils.tensorboard.SummaryWriter``; needs the ``tensorboard`` package: the ``tensorboard`` extra).

Scalars are TensorBoard's plain ones (a float32 ``simple_value``, as Hugging Face's and Lightning's
TensorBoard loggers write them): each point is the float32 nearest the StepResult's float. The
float64 form (``add_scalar(..., new_style=True, double_precision=True)``) would keep every digit, but
TensorBoard 2.21's default reader (its Rust data server, ``--load_fast=auto``) shows none of those
scalars: the scalars page stays empty. Read them back with
``tensorboard.backend.event_processing.event_accumulator``'s ``EventAccumulator(logdir).Scalars(tag)``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from zeroray.tracking.scalars import Tracker, require


class TensorBoardCallback(Tracker):
    """Logs to one event file under ``log_dir`` (made if missing), opened when the first value
    comes. ``flush_secs``: how often the writer flushes between fits (each fit's end flushes)."""

    def __init__(self, log_dir: Any, flush_secs: int = 30) -> None:
        require("tensorboard", "tensorboard", "TensorBoardCallback")  # torch's writer needs it
        self.log_dir, self.flush_secs = os.fspath(log_dir), flush_secs
        self._writer: Optional[Any] = None

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, flush_secs=self.flush_secs)
        return self._writer

    def log_scalars(self, step: int, values: Dict[str, float]) -> None:
        writer = self._open()
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)

    def on_evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        super().on_evaluation(step, metrics)
        self.flush()  # a standalone evaluate has no fit end to flush it

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
