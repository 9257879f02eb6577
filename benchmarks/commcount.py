"""Count the bytes a torch.distributed peer communicates, by wrapping the collectives.

FSDP2 (``dist.all_gather_single`` / ``dist.reduce_scatter_single``), DeepSpeed's torch backend
and our DDP comm hook (``dist.all_reduce``) all call the collectives through the
``torch.distributed`` package namespace, so replacing those attributes sees every call they
make. Calls made inside ``distributed_c10d`` itself resolve to its own globals and are not
seen twice. Payload sizes are turned into bytes sent per worker with the ring formulas of
[Note: bytes per worker] in common.py.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Callable, Dict

from common import ring_bytes_sent

# collective kind, and the argument whose size is the payload (a tensor or a list of tensors)
_WRAPPED = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


class CommCounter:
    """Per-collective payload bytes, calls and ring bytes sent since the last ``reset``."""

    def __init__(self) -> None:
        self._originals: Dict[str, Callable] = {}
        self.reset()

    def reset(self) -> None:
        # Named as in zr.Trainer.comm_report(): "bytes" is what this worker sent (ring model),
        # "payload_bytes" the size of the tensors handed to the collective.
        self.collectives = defaultdict(lambda: {"bytes": 0.0, "calls": 0, "payload_bytes": 0})

    def install(self) -> "CommCounter":
        import torch.distributed as dist

        for name, (kind, arg) in _WRAPPED.items():
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(fn, kind, arg))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, fn: Callable, kind: str, arg: str) -> Callable:
        import torch.distributed as dist

        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            payload = _nbytes(bound.arguments[arg]) if arg in bound.arguments else 0
            world_size = dist.get_world_size(bound.arguments.get("group"))
            entry = self.collectives[kind]
            entry["payload_bytes"] += payload
            entry["calls"] += 1
            entry["bytes"] += ring_bytes_sent(kind, payload, world_size)
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn
        return counted

    def report(self) -> dict:
        """Same shape as one worker's entry of ``zr.Trainer.comm_report()``, plus payload."""
        collectives = {k: dict(v) for k, v in self.collectives.items()}
        return {
            "total_bytes": sum(v["bytes"] for v in collectives.values()),
            "payload_bytes": sum(v["payload_bytes"] for v in collectives.values()),
            "collectives": collectives,
        }
