"""Whether data given to fit or evaluate is a ``ray.data.Dataset`` (without importing ray.data).

Shared by fit (fit/loop.py, fit/data.py, fit/evaluation.py), the pipeline's evaluation
(execution/pipeline.py) and the stage choice (auto_stage.py); it imports nothing of theirs.
"""
from __future__ import annotations

import sys
from typing import Any


def is_ray_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``ray.data.Dataset``, without importing ray.data (seconds) for a list."""
    ray_data = sys.modules.get("ray.data")  # a Dataset exists only once ray.data was imported
    return ray_data is not None and isinstance(data, ray_data.Dataset)
