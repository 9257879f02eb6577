"""fit's data feeds: the driver's own batches (``BatchFeed``), or Ray Data input, where every worker
pulls its own split of a ``ray.data.Dataset`` (``RayDataFeed``, the driver side).

``trainer.fit(dataset, batch_size=GLOBAL)`` cuts the dataset with
``dataset.streaming_split(num_workers, equal=True)``, in a fixed order ([Note: Ray Data
replay]), and hands split ``r`` to worker ``r``, which iterates it itself in local batches of
``GLOBAL // num_workers`` rows (worker/local_feed.py, the worker side, and [Note: Ray Data batches]
there). Rows go from Ray Data's executor straight to the worker that trains on them, never
through the driver; each step the driver only tells every worker "train on your next batch"
(``train_next``). This side never imports the worker's, nor the worker this one.

[Note: Ray Data replay]
``trainer.data_position`` counts global batches, as for any other data. A fit that starts at
position ``p`` (``skip=p``, a restored checkpoint, or recovery after a worker failure)
starts a fresh pass over the dataset and each worker discards its first ``p`` local batches.
That replays exactly the rows of the interrupted pass because every pass cuts the dataset the
same way: fit runs the split with Ray Data's ``preserve_order`` on (on a copy of the dataset,
whose own context stays as the user set it). Ray Data's split operator hands each block, in
the order the blocks arrive, to the split that has received the fewest rows so far, and
evens out the last ones; without ``preserve_order`` the blocks arrive in the order their
tasks finish (a read or ``map_batches`` that is sometimes slower reorders them), with it in
the dataset's own order. So split ``r`` holds the same rows, in the same order, on every
pass, and local batch ``k`` of worker ``r`` is the same rows after a recovery as before it
(tests/ray/test_ray_data_replay.py). Two limits: the dataset itself must produce the same
rows in the same order on each pass (a ``random_shuffle`` without a seed does not), and a
restart at another number of workers (``min_workers``) cuts other splits, so it resumes after
the same number of rows but not necessarily the same ones. Keeping the order may cost
throughput when upstream tasks finish out of order (blocks wait for their predecessors);
benchmarks/README.md has the figure for ``benchmarks/ray_data_throughput.py``.

One ``fit`` call is one pass at most: it stops when the splits run out.
"""
from __future__ import annotations

import itertools
import uuid
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from zeroray.engine.batch import split_sizes
from zeroray.runtime.data_source import is_ray_dataset
from zeroray.runtime.execution.pipeline import StepPipeline
from zeroray.runtime.execution.step import PendingStep


def local_batch_size(global_batch_size: Any, num_workers: int, grad_accum_steps: int) -> int:
    """Each worker's local batch: ``global_batch_size / num_workers`` rows, which must be whole
    ([Note: Ray Data batches] in worker/local_feed.py says why a Ray Data split cannot be uneven); its
    micro-batches may be (6 rows over 4 micro-batches: 2, 2, 1, 1; [Note: uneven splits] in
    engine/batch.py)."""
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError("fit(dataset) with a ray.data.Dataset needs batch_size= (the global batch size, in rows, "
                         f"split evenly over the workers), got {global_batch_size!r}")
    if global_batch_size % num_workers:
        below = global_batch_size // num_workers * num_workers
        above = below + num_workers
        raise ValueError(
            f"fit(dataset): batch_size={global_batch_size} does not split evenly over {num_workers} worker(s). With a "
            "ray.data.Dataset every worker reads its own equal split in local batches of batch_size / num_workers "
            f"rows, so batch_size must be divisible by {num_workers} (the workers): use "
            + (f"{below} or {above}" if below else f"{above}")
            + (f"; or pass fit an iterable of global batches, which zeroray splits unevenly ({global_batch_size} rows "
               f"over {num_workers} workers: {', '.join(map(str, split_sizes(global_batch_size, num_workers)))})"
               if global_batch_size >= num_workers * grad_accum_steps else ""))
    local = global_batch_size // num_workers
    if local < grad_accum_steps:
        raise ValueError(f"fit(dataset): batch_size={global_batch_size} gives each of the {num_workers} worker(s) "
                         f"{local} row(s), fewer than its {grad_accum_steps} micro-batches (grad_accum_steps): "
                         f"use batch_size >= {num_workers * grad_accum_steps}")
    return local


def _in_fixed_order(dataset: Any) -> Any:
    """The same dataset, executed with ``preserve_order``: see [Note: Ray Data replay]. A deep
    copy (Ray Data's own ``Dataset.copy``) carries a copy of the context, so the user's dataset
    and Ray Data's global context are left as they were."""
    with warnings.catch_warnings():  # copying the context reads Ray Data's deprecated options
        warnings.simplefilter("ignore", DeprecationWarning)
        ordered = type(dataset).copy(dataset, _deep_copy=True)
    ordered.context.execution_options.preserve_order = True
    return ordered


class RayDataFeed:
    """fit's source of steps for a ``ray.data.Dataset``: each worker pulls its own split.

    Cuts ``dataset`` with ``streaming_split(num_workers, equal=True)``, in a fixed order, and
    attaches split ``r`` to worker ``r`` of the pipeline's group, skipping ``skip`` local
    batches ([Note: Ray Data replay]). ``send`` sends one step on every worker's next batch
    through the pipeline (None once the splits are known to be empty); ``close`` detaches the
    splits (fit closes the feed when it ends, and on recovery, when the group it was attached
    to is already gone).
    """

    def __init__(self, pipeline: StepPipeline, dataset: Any, global_batch_size: Optional[int], skip: int,
                 grad_accum_steps: int) -> None:
        num_workers = pipeline.num_workers
        local = local_batch_size(global_batch_size, num_workers, grad_accum_steps)
        self.pipeline, self.feed_id = pipeline, uuid.uuid4().hex
        splits = _in_fixed_order(dataset).streaming_split(num_workers, equal=True)
        infos = pipeline.attach(splits, local, skip, self.feed_id)  # a SplitInfo per worker
        self.empty = not all(info.has_next for info in infos)
        self.tokens = sum(info.tokens for info in infos) or None

    def send(self) -> Optional[PendingStep]:
        """A step on every worker's next local batch, or None when the splits are empty."""
        if self.empty:
            return None
        return self.pipeline.send_local(tokens=self.tokens)

    def close(self) -> None:
        self.pipeline.detach(self.feed_id)


class BatchFeed:
    """fit's source of steps for an iterable of global batches: the driver sends each batch."""

    def __init__(self, pipeline: StepPipeline, data: Any, skip: int) -> None:
        self.pipeline = pipeline
        self.batches = itertools.islice(iter(data), skip, None)

    def send(self) -> Optional[PendingStep]:
        """A step on the next batch, sent through the pipeline; None when the data has ended."""
        for batch in self.batches:
            return self.pipeline.send(batch, tokens=_tokens(batch))
        return None

    def close(self) -> None:
        pass


def _tokens(batch: Any) -> Optional[int]:
    first = batch[0] if isinstance(batch, (list, tuple)) else (
        next(iter(batch.values())) if isinstance(batch, Mapping) else batch)
    return int(first.numel()) if isinstance(first, torch.Tensor) else None


Feed = Union[BatchFeed, RayDataFeed]


def feed_for(controller: Any, data: Any, batch_size: Optional[int]) -> Feed:
    """fit's source of steps for ``data`` on the controller's pipeline, from its data position: a
    Ray Data feed (every worker pulls its own split) or the driver's own batches."""
    if is_ray_dataset(data):
        return RayDataFeed(controller.pipeline, data, batch_size, controller.data_position,
                           controller.zero.grad_accum_steps)
    return BatchFeed(controller.pipeline, data, controller.data_position)


def replayable(data: Any) -> bool:
    """Whether fit can iterate ``data`` again after a failure ([Note: data replay] in fit/loop.py)."""
    return is_ray_dataset(data) or iter(data) is not data
