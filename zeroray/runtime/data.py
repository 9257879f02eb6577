"""Ray Data input: every worker pulls its own split of a ``ray.data.Dataset``.

``trainer.fit(dataset, batch_size=GLOBAL)`` cuts the dataset with
``dataset.streaming_split(num_workers, equal=True)`` and hands split ``r`` to worker ``r``,
which iterates it itself in local batches of ``GLOBAL // num_workers`` rows. Rows go from
Ray Data's executor straight to the worker that trains on them, never through the driver;
each step the driver only tells every worker "train on your next batch" (``train_next``).

[Note: Ray Data batches]
A worker's batch is a dict ``{column name: tensor}`` with dim 0 the local batch, and that
dict is what ``loss_fn(model, batch)`` receives. Numeric and bool columns become tensors of
their own dtype (zero-copy where numpy allows); a column of equal-shape arrays (a tensor
column) becomes one tensor of shape ``(rows, *shape)``. A column with no tensor form
(strings, ragged lists) is a ``ValueError`` naming it: drop it or encode it to numbers with
``dataset.map_batches`` before fit. Every split holds the same number of rows
(``equal=True``, which may drop up to ``num_workers - 1`` rows) and each worker drops its
last partial batch, so all workers run out of batches on the same step.

Global-batch semantics are those of ``trainer.step``: the step's global batch is the
concatenation of the workers' local batches in rank order, and the loss, gradients and
update equal ``trainer.step`` on that concatenation (tests/ray/test_ray_data.py checks it).

[Note: Ray Data replay]
``trainer.data_position`` counts global batches, as for any other data. A fit that starts at
position ``p`` (``skip=p``, a restored checkpoint, or recovery after a worker failure)
starts a fresh pass over the dataset and each worker discards its first ``p`` local batches,
so training resumes after the same number of rows. It is position-exact, not row-exact:
``streaming_split`` hands blocks to whichever split asks first, so which rows land in which
split (and in which step) may differ from one pass to the next. After a resume some rows of
the interrupted pass may be seen twice and others not at all; this is the usual contract of
streaming input (Ray Train's is the same). For row-exact replay, feed an iterable of global
batches instead (``fit`` replays those exactly; see [Note: data replay] in fit_loop.py).

One ``fit`` call is one pass at most: it stops when the splits run out.
"""
from __future__ import annotations

import uuid
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch


def is_ray_dataset(data: Any) -> bool:
    try:
        import ray.data
    except ImportError:
        return False
    return isinstance(data, ray.data.Dataset)


# --- worker side ---------------------------------------------------------------------------


def to_tensors(columns: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A numpy batch from Ray Data (column -> array) as a dict of tensors; see [Note: Ray Data batches]."""
    out = {}
    for name, column in columns.items():
        array = np.asarray(column)
        if array.dtype == object:  # a tensor column whose rows numpy kept as separate arrays
            try:
                array = np.array(array.tolist())
            except ValueError:
                raise ValueError(f"column {name!r} holds rows of different shapes (ragged), which make no "
                                 "tensor: pad them to one length with dataset.map_batches(...) or drop the column "
                                 f"(dataset.drop_columns([{name!r}])) before fit") from None
        if array.dtype.kind not in "biufc":
            raise ValueError(f"column {name!r} has dtype {array.dtype}, which has no tensor form: encode it to "
                             f"numbers with dataset.map_batches(...) or drop it (dataset.drop_columns([{name!r}])) "
                             "before fit")
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # torch tensors must own writable memory
        out[name] = torch.from_numpy(array)
    return out


class LocalFeed:
    """One worker's split, one local batch ahead.

    The look-ahead lets ``train_next`` report, with the result of a step, whether the worker
    has another batch: the driver then never starts a step that some rank cannot join (a
    rank without a batch would leave the others waiting in a collective).
    """

    def __init__(self, split: Any, batch_size: int, skip: int, feed_id: str) -> None:
        self.feed_id = feed_id
        self._batches = iter(split.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True,
                                                prefetch_batches=1))
        for _ in range(skip):  # see [Note: Ray Data replay]
            if next(self._batches, None) is None:
                break
        self._next: Optional[Dict[str, torch.Tensor]] = None
        self.advance()

    def advance(self) -> None:
        raw = next(self._batches, None)
        self._next = None if raw is None else to_tensors(raw)

    def has_next(self) -> bool:
        return self._next is not None

    def take(self) -> Dict[str, torch.Tensor]:
        if self._next is None:
            raise RuntimeError("this worker's Ray Data split has no batch left (the driver should have stopped)")
        batch, self._next = self._next, None
        return batch

    def peek_info(self) -> Dict[str, Any]:
        """Rows and tokens of the next batch: tokens is the largest column's element count."""
        if self._next is None:
            return {"has_next": False, "rows": 0, "tokens": 0}
        sizes = [t.numel() for t in self._next.values()]
        return {"has_next": True, "rows": next(iter(self._next.values())).shape[0], "tokens": max(sizes)}


# --- driver side ---------------------------------------------------------------------------


class WorkerStep:
    """One step whose batch is already on the workers (what fit's loop gets instead of a batch).

    ``run()`` tells every worker to train on its next local batch and returns the StepResult.
    """

    def __init__(self, trainer: Any, group: Any, num_tokens: int) -> None:
        self.trainer, self.group, self.num_tokens = trainer, group, num_tokens
        self.has_next = False

    def run(self) -> Any:
        trainer = self.trainer
        refs = self.group.call("train_next")
        outs = self.group.wait_all(refs, trainer.zero.collective_timeout_s + 60, f"step {trainer.step_count}")
        self.has_next = all(o["has_next"] for o in outs)
        if self.has_next != any(o["has_next"] for o in outs):  # equal=True makes this impossible
            raise RuntimeError("the workers' Ray Data splits ran out on different steps: "
                               f"{[o['has_next'] for o in outs]}")
        return trainer._record_step(outs)


def local_batch_size(global_batch_size: Any, num_workers: int, grad_accum_steps: int) -> int:
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError("fit(dataset) with a ray.data.Dataset needs batch_size= (the global batch size, in rows, "
                         f"split evenly over the workers), got {global_batch_size!r}")
    parts = num_workers * grad_accum_steps
    if global_batch_size % parts:
        raise ValueError(f"batch_size={global_batch_size} does not split evenly over {num_workers} worker(s) x "
                         f"{grad_accum_steps} micro-batch(es): use a batch size divisible by {parts}")
    return global_batch_size // num_workers


def worker_steps(trainer: Any, dataset: Any, global_batch_size: Optional[int], skip: int) -> Iterator[WorkerStep]:
    """Split ``dataset`` over the trainer's workers; an iterator of one WorkerStep per global batch.

    The batch size is checked now; the splits are attached to the workers on the first ``next()``.
    They are detached from the workers of the group they were given to when the iterator is
    closed or dropped (fit's loop drops it on recovery, when that group is already gone).
    """
    group = trainer._group
    local = local_batch_size(global_batch_size, group.num_workers, trainer.zero.grad_accum_steps)
    splits = dataset.streaming_split(group.num_workers, equal=True)
    return _steps(trainer, group, splits, local, skip)


def _steps(trainer: Any, group: Any, splits: List[Any], local: int, skip: int) -> Iterator[WorkerStep]:
    feed_id = uuid.uuid4().hex
    try:
        infos: List[Dict[str, Any]] = group.wait_all(
            group.call_each("attach_data", [(split, local, skip, feed_id) for split in splits]), None,
            "attach the Ray Data splits")
        has_next = all(info["has_next"] for info in infos)
        num_tokens = sum(info["tokens"] for info in infos)
        while has_next:
            step = WorkerStep(trainer, group, num_tokens)
            yield step
            has_next = step.has_next
    finally:
        for actor in group.actors:  # best effort: the group may be shut down already
            try:
                actor.detach_data.remote(feed_id)
            except Exception:  # noqa: BLE001
                pass
