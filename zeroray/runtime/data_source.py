"""What the driver iterates itself: whether fit's data is a ``ray.data.Dataset``, and the
global batches of an evaluation (an iterable of them, or a Dataset read on the driver).

Shared by fit (fit/loop.py, fit/data.py), the pipeline's evaluation (execution/pipeline.py) and the stage
choice (auto_stage.py); it imports nothing of theirs.
"""
from __future__ import annotations

import sys
from typing import Any, Iterator, Optional


def is_ray_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``ray.data.Dataset``, without importing ray.data (seconds) for a list."""
    ray_data = sys.modules.get("ray.data")  # a Dataset exists only once ray.data was imported
    return ray_data is not None and isinstance(data, ray_data.Dataset)


def evaluation_batches(data: Any, dataset_batch_size: Optional[int]) -> Iterator[Any]:
    """The global batches of ``trainer.evaluate``'s data: an iterable of them as it is, or a
    ``ray.data.Dataset`` read on the driver in dicts of ``dataset_batch_size`` rows (the last
    partial batch dropped, as fit drops it). Evaluation data is small next to training data, so
    it goes through the driver rather than through per-worker splits."""
    if is_ray_dataset(data):
        if not isinstance(dataset_batch_size, int) or isinstance(dataset_batch_size, bool) or dataset_batch_size < 1:
            raise ValueError("evaluate with a ray.data.Dataset needs batch_size= (the global batch size, in rows, "
                             f"split over the workers), got {dataset_batch_size!r}")
        return iter(data.iter_torch_batches(batch_size=dataset_batch_size, drop_last=True))
    if dataset_batch_size is not None:
        raise ValueError("evaluate: batch_size= is for a ray.data.Dataset; an iterable of global batches has the "
                         "sizes of its batches")
    try:
        return iter(data)
    except TypeError:
        raise ValueError("evaluate needs an iterable of global batches (a list of tensors or of tuples/dicts of "
                         f"tensors) or a ray.data.Dataset, got {type(data).__name__}") from None
