"""fit's data feeds (execution/pipeline.py's ``Feed``): the driver's own batches, or Ray Data input,
where every worker pulls its own split of a ``ray.data.Dataset`` (``ray_data_feed``, the driver side).

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
from typing import Any, Optional

from zeroray.engine.batch import split_sizes
from zeroray.runtime.data_source import is_ray_dataset
from zeroray.runtime.execution.pipeline import Feed, StepPipeline


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


def ray_data_feed(pipeline: StepPipeline, dataset: Any, global_batch_size: Optional[int], skip: int,
                  grad_accum_steps: int) -> Feed:
    """fit's source of steps for a ``ray.data.Dataset``: each worker pulls its own split.

    Cuts ``dataset`` with ``streaming_split(num_workers, equal=True)``, in a fixed order, and
    attaches split ``r`` to worker ``r`` of the pipeline's group, skipping ``skip`` local
    batches ([Note: Ray Data replay]). The pipeline then steps every worker on its split's next
    batch (``send_local``) and detaches the splits when its run ends (on recovery too, when the
    group they were attached to is already gone).
    """
    num_workers = pipeline.num_workers
    local = local_batch_size(global_batch_size, num_workers, grad_accum_steps)
    feed_id = uuid.uuid4().hex
    splits = _in_fixed_order(dataset).streaming_split(num_workers, equal=True)
    infos = pipeline.attach(splits, local, skip, feed_id)  # a SplitInfo per worker
    return Feed(feed_id=feed_id, tokens=sum(info.tokens for info in infos) or None,
                empty=not all(info.has_next for info in infos))


def feed_for(pipeline: StepPipeline, data: Any, batch_size: Optional[int]) -> Feed:
    """fit's source of steps for ``data`` on ``pipeline``, from its data position: a Ray Data feed
    (every worker pulls its own split) or the driver's own batches, sent by the pipeline one by one."""
    skip = pipeline.position.data_position
    if is_ray_dataset(data):
        return ray_data_feed(pipeline, data, batch_size, skip, pipeline.zero.grad_accum_steps)
    return Feed(batches=itertools.islice(iter(data), skip, None))


def replayable(data: Any) -> bool:
    """Whether fit can iterate ``data`` again after a failure ([Note: data replay] in fit/loop.py)."""
    return is_ray_dataset(data) or iter(data) is not data
