"""How a batch shard travels from the driver to a worker: as numpy bytes, not as pickled tensors.

[Note: batch transport]
Ray pickles a ``torch.Tensor`` argument through torch's own reducer, which runs ``torch.save``
on the driver and ``torch.load`` on the worker for every storage, and ships the tensor's whole
storage even when the tensor is a slice of it (a worker's rows of the global batch). Measured in
``benchmarks/ray_overhead.py``, that was most of what a step's call cost beyond Ray's own round
trip. A numpy array instead goes through pickle protocol 5 as one out-of-band buffer (Ray's
zero-copy path) holding only the slice's bytes. So ``pack`` replaces every CPU tensor of the
batch by its bytes (a ``uint8`` array, any dtype, bfloat16 included) with dtype and shape, and
``unpack`` on the worker rebuilds the tensors. Both classes pickle as pickle pickles any object
with ``__slots__`` (their fields as they are, no ``__init__`` on the way back), so no zeroray
code runs inside Ray's serialization. Ray hands the worker read-only buffers (the object store's
shared memory); ``unpack`` copies those, so ``loss_fn`` gets ordinary writable tensors. Tensors
on a GPU travel as they are.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class _WireTensor:
    """One CPU tensor as bytes: what ``pack`` puts where the tensor was."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # 1-D bytes
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)

    def tensor(self) -> torch.Tensor:
        data = self.data if self.data.flags.writeable else np.array(self.data)
        return torch.from_numpy(data).view(self.dtype).view(self.shape)


class PackedBatch:
    """A batch (tensor, or tuple/list/dict of them) ready to travel; see [Note: batch transport]."""

    __slots__ = ("tree",)

    def __init__(self, batch: Any) -> None:
        self.tree = _map(batch, lambda t: _WireTensor(t) if t.device.type == "cpu" else t, torch.Tensor)

    def unpack(self) -> Any:
        return _map(self.tree, lambda w: w.tensor(), _WireTensor)


def _map(tree: Any, fn, kind: type) -> Any:
    if isinstance(tree, kind):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn, kind) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn, kind) for v in tree)
    return tree


def unpack(batch: Any) -> Any:
    """The batch as the driver gave it: tensors rebuilt from a PackedBatch, anything else as is."""
    return batch.unpack() if isinstance(batch, PackedBatch) else batch
