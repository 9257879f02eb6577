"""Global batches: a tensor, or a tuple/list/dict of tensors whose dim 0 is the batch.

Splitting them over workers and micro-batches, and moving them to a device. A dict may be any
mapping: Hugging Face's collators return a ``BatchEncoding`` (a ``UserDict``), whose pieces
arrive on the workers as plain dicts (``model(**batch)`` takes either). Nothing about a batch
is fixed from one step to the next: its rows may change shape (a collator that pads each
batch to its longest sequence), and so may its structure; each step runs the user's code on
whatever it is given, as DDP does.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, List

import torch


def split_batch(batch: Any, parts: int, what: str = "batch") -> List[Any]:
    """Split a tensor / tuple / list / dict of tensors along dim 0 into ``parts`` equal pieces."""
    size = batch_size(batch)
    if size % parts:
        raise ValueError(f"the {what} has {size} rows, which does not split evenly into {parts} parts: "
                         f"use a batch size divisible by {parts}")
    n = size // parts
    return [_slice(batch, i * n, (i + 1) * n) for i in range(parts)]


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
