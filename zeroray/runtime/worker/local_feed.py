"""The worker side of Ray Data input: one worker's split of a ``ray.data.Dataset``, read in local batches.

``Worker.attach_data`` builds a ``LocalFeed`` on the split the driver cut for it (fit/data.py,
the driver side) and ``Worker.train_next`` takes one batch per step.

[Note: Ray Data batches]
A worker's batch is a dict ``{column name: tensor}`` with dim 0 the local batch, and that
dict is what ``loss_fn(model, batch)`` receives. Numeric and bool columns become tensors of
their own dtype (zero-copy where numpy allows); a column of equal-shape arrays (a tensor
column) becomes one tensor of shape ``(rows, *shape)``. A column with no tensor form
(strings, ragged lists) is a ``ValueError`` naming it: drop it or encode it to numbers with
``dataset.map_batches`` before fit. Every split holds the same number of rows
(``equal=True``, which may drop up to ``num_workers - 1`` rows) and each worker drops its
last partial batch, so all workers run out of batches on the same step. That is why the local
batches are equal (``batch_size`` must divide by the number of workers; fit/data.py refuses it
otherwise): with local batches of 6, 5 and 5 rows, equal splits would run out after different
numbers of steps, and the workers that still had a batch would wait in the step's collectives for
one that has none. A worker's micro-batches may still be uneven ([Note: uneven splits] in
engine/batch.py).

Global-batch semantics are those of ``trainer.step``: the step's global batch is the
concatenation of the workers' local batches in rank order, and the loss, gradients and
update equal ``trainer.step`` on that concatenation (tests/ray/test_ray_data.py checks it).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from zeroray.runtime.records import SplitInfo


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
    """One worker's split, read in local batches.

    At attach it reads the first batch ahead, so the driver learns the tokens per step before
    the first step (progress's tokens/s); after that each ``take`` reads its own batch (Ray
    Data's ``prefetch_batches`` already reads ahead in the background). Every split holds the
    same number of batches ([Note: Ray Data batches]), so every worker's ``take`` runs out on
    the same step and the driver's pipelined call behind the last step finds nothing to do.
    """

    def __init__(self, split: Any, batch_size: int, skip: int, feed_id: str) -> None:
        self.feed_id = feed_id
        self._batches = iter(split.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True,
                                                prefetch_batches=1))
        for _ in range(skip):  # see [Note: Ray Data replay]
            if next(self._batches, None) is None:
                break
        self._ahead: Optional[Dict[str, torch.Tensor]] = self._read()

    def _read(self) -> Optional[Dict[str, torch.Tensor]]:
        raw = next(self._batches, None)
        return None if raw is None else to_tensors(raw)

    def take(self) -> Optional[Dict[str, torch.Tensor]]:
        """The next local batch; None when the split has run out."""
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
            return batch
        return self._read()

    def peek_info(self) -> SplitInfo:
        """Rows and tokens of the first batch: tokens is the largest column's element count."""
        if self._ahead is None:
            return SplitInfo(has_next=False)
        sizes = [t.numel() for t in self._ahead.values()]
        return SplitInfo(has_next=True, rows=int(next(iter(self._ahead.values())).shape[0]), tokens=max(sizes))
