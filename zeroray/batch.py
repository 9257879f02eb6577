"""Global batches: a tensor, or a tuple/list/dict of tensors whose dim 0 is the batch.

Splitting them over workers and micro-batches, moving them to a device, and describing
their structure (to tell a user whose batches change shape between steps what changed).
"""
from __future__ import annotations

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
    leaves = _leaves(batch)
    if not leaves:
        raise ValueError("the batch holds no tensors: pass a tensor, or a tuple/list/dict of tensors")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"every tensor of the batch needs the same dim 0 (the batch), got sizes {sorted(map(str, sizes))}")
    return sizes.pop()


def batch_structure(batch: Any) -> Any:
    """Structure and per-row shapes/dtypes: to detect batches that change shape between steps."""
    if isinstance(batch, torch.Tensor):
        return ("T", tuple(batch.shape[1:]), str(batch.dtype))
    if isinstance(batch, dict):
        return ("D", tuple((k, batch_structure(v)) for k, v in sorted(batch.items())))
    if isinstance(batch, (list, tuple)):
        return ("L", tuple(batch_structure(v) for v in batch))
    return ("O", type(batch).__name__)


def structure_changed(step: int, before: Any, after: Any) -> str:
    """The message for a batch whose structure differs from the first step's."""
    return (f"step {step}: the batch structure changed from {describe_structure(before)} to "
            f"{describe_structure(after)} (N = rows, which may vary); every step must get batches of the same "
            "structure, row shapes and dtypes: pad or crop them to one shape, or build a new Trainer for the new one")


def describe_structure(structure: Any) -> str:
    """batch_structure() in words, e.g. ``(tensor[N, 5] int64, tensor[N, 5] int64)``."""
    kind, rest = structure[0], structure[1:]
    if kind == "T":
        shape, dtype = rest
        return f"tensor[{', '.join(['N'] + [str(d) for d in shape])}] {dtype.replace('torch.', '')}"
    if kind == "D":
        return "{" + ", ".join(f"{k!r}: {describe_structure(v)}" for k, v in rest[0]) + "}"
    if kind == "L":
        return "(" + ", ".join(describe_structure(v) for v in rest[0]) + ")"
    return str(rest[0])


def _leaves(batch: Any) -> List[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _leaves(v)]
    return []


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, dict):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, lo, hi) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
