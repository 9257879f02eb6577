"""Global batches: a tensor, or a tuple/list/dict of tensors whose dim 0 is the batch.

Splitting them over workers and micro-batches, and moving them to a device. A dict may be any
mapping: Hugging Face's collators return a ``BatchEncoding`` (a ``UserDict``), whose pieces
arrive on the workers as plain dicts (``model(**batch)`` takes either). Nothing about a batch
is fixed from one step to the next: its rows may change shape (a collator that pads each
batch to its longest sequence), and so may its structure; each step runs the user's code on
whatever it is given, as DDP does.

[Note: uneven splits]
A global batch of N rows splits over W workers, then each worker's share over its k
micro-batches, as ``numpy.array_split`` cuts: the first ``N % parts`` parts get one row more
(16 rows over 3 workers: 6, 5, 5). Every part needs a row (N >= W * k), else a ``ValueError``:
a part with no rows has no mean loss to take. Each part's loss is weighted by its share of the
rows, ``n_p / N`` (``part_weights``: the engine scales part p's loss by ``n_p * W * k / N``
before backward, and the reduction's coefficient ``1 / (W * k)`` is the one of equal parts),
so with a per-row mean loss a step is exactly the single-process step on the whole batch,
whatever W and k are, and a run resumed at another worker count goes on as one run. When the
parts are equal every weight is exactly 1 and the step is bitwise the equal split's. With a
per-token mean over padding the step's loss is the row-weighted mean of the parts' per-token
means, ``sum_p n_p / N * L_p``, which with equal parts is DDP's mean of the workers' per-token
means. The reported loss and evaluation are weighted the same way.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, List

import torch


def split_sizes(rows: int, parts: int, what: str = "batch") -> List[int]:
    """The rows of each of ``parts`` pieces of ``rows`` rows: the first ``rows % parts`` get one more
    ([Note: uneven splits])."""
    if rows < parts:
        raise ValueError(f"the {what} has {rows} rows, fewer than its {parts} parts: each part needs at least one "
                         f"row; use at least {parts} rows")
    base, extra = divmod(rows, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def split_batch(batch: Any, parts: int, what: str = "batch") -> List[Any]:
    """Split a tensor / tuple / list / dict of tensors along dim 0 into ``parts`` pieces of
    ``split_sizes`` rows (equal when ``parts`` divides the rows)."""
    bounds = [0]
    for n in split_sizes(batch_size(batch), parts, what):
        bounds.append(bounds[-1] + n)
    return [_slice(batch, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def part_weights(sizes: List[int], global_rows: int, num_parts: int) -> List[float]:
    """The factor each part's loss is scaled by so that, summed and divided by ``num_parts``
    (the workers x micro-batches of an equal split), the parts weigh ``n_p / global_rows``:
    ``n_p * num_parts / global_rows``, exactly 1.0 for every part of an equal split
    ([Note: uneven splits])."""
    return [n * num_parts / global_rows for n in sizes]


def batch_size(batch: Any) -> int:
    leaves = tensors(batch)
    if not leaves:
        raise ValueError("the batch holds no tensors: pass a tensor, or a tuple/list/dict of tensors")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"every tensor of the batch needs the same dim 0 (the batch), got sizes {sorted(map(str, sizes))}")
    return sizes.pop()


def tensors(batch: Any) -> List[torch.Tensor]:
    """The tensors of a batch, in order (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in tensors(v)]
    return []


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, Mapping):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, lo, hi) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
