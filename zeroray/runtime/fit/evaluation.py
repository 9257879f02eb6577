"""fit's evaluations: ``evaluate(eval_data)`` every ``eval_every`` steps and once at the end.

``FitEvaluation`` is the schedule, as data: the step pipeline's ``run`` (execution/pipeline.py)
evaluates on it. An evaluation runs only between complete steps: the pipeline sends no step
behind one that an evaluation follows, and collects that step first (as for a checkpoint,
[Note: pipelined steps] in fit/loop.py), so the evaluation sees exactly the weights of the step
it reports. Its values go where the steps' go: the progress bar or log lines, the metrics file
(one record ``{"step", "eval_loss", "eval_<metric>", "time"}``) and the ``evaluation`` of the
StepResult of the step it followed, and to the callbacks' ``on_evaluation`` (fit/callbacks.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from zeroray.runtime.data_source import is_ray_dataset


class FitEvaluation:
    """The evaluation schedule of one fit; ``of`` checks fit's arguments and builds it."""

    def __init__(self, data: Any, every: Optional[int], metric_fn: Optional[Callable],
                 dataset_batch_size: Optional[int]) -> None:
        self.data, self.every, self.metric_fn, self.dataset_batch_size = data, every, metric_fn, dataset_batch_size

    @staticmethod
    def of(data: Any, every: Optional[int], metric_fn: Optional[Callable],
           dataset_batch_size: Optional[int]) -> Optional["FitEvaluation"]:
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"eval_every={every!r} must be an int >= 1 (evaluate every that many steps), or None "
                             "to evaluate once, at the end of fit")
        if data is None:
            if every is not None or metric_fn is not None:
                raise ValueError("eval_every and eval_metric_fn need eval_data= (the batches to evaluate on)")
            return None
        if metric_fn is not None and not callable(metric_fn):
            raise ValueError("eval_metric_fn must be a callable (model, batch) -> dict of name -> float, "
                             f"got {type(metric_fn).__name__}")
        if is_ray_dataset(data) and dataset_batch_size is None:
            raise ValueError("eval_data is a ray.data.Dataset: give fit batch_size= (the global batch size, in rows) "
                             "to read it in batches")
        if not is_ray_dataset(data) and iter(data) is data:
            raise ValueError("eval_data must be re-iterable (a list of batches, or an object whose __iter__ starts "
                             "over) or a ray.data.Dataset: fit evaluates it more than once; got a one-shot iterator")
        return FitEvaluation(data, every, metric_fn, dataset_batch_size)
