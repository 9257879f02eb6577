"""One rank's training state as flat tensors and scalars, for checkpoints and recovery.

Tensors are fp32 and in this rank's shard coordinates at every stage (the storage converts
stage 0's full tensors, engine/storage.py); scalars are the step count, the loss scaler's
state and the random number generator's, which is what makes a resumed run draw the same
numbers (dropout) as one that never stopped.
"""
from __future__ import annotations

import base64
from typing import Any, Dict, Optional, Tuple

import torch

from zeroray.engine.optim import LossScaler, ShardedOptimizer


def export_state(storage, optimizer: ShardedOptimizer, step: int, scaler: Optional[LossScaler],
                 live: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Flat fp32 tensors in this rank's shard coordinates, and per-rank scalars. ``live``: a
    tensor may be the engine's own (the master, the optimizer's flat state) where it already is
    one in those coordinates; the next update changes it (see ``Engine.export_state``)."""
    tensors, scalars = optimizer.export_state(live)
    tensors = storage.exported(tensors)
    tensors["master"] = storage.master_shard(live)
    scalars["step"] = step
    scalars["scaler"] = scaler.state() if scaler else None
    scalars["rng"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return tensors, scalars


def import_state(storage, optimizer: ShardedOptimizer, scaler: Optional[LossScaler],
                 tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> int:
    """Load tensors given in ``storage.state_layout()`` coordinates into the master and the
    optimizer, and the scalars; the step count to resume at. The caller finishes gathers in
    flight before and publishes the master after."""
    tensors = storage.imported(tensors)
    with torch.no_grad():
        storage.master.copy_(tensors["master"].to(storage.master.device))
    optimizer.import_state({k: v for k, v in tensors.items() if k != "master"}, scalars)
    if scaler is not None and scalars.get("scaler"):
        scaler.load(scalars["scaler"])
    if scalars.get("rng"):
        state = torch.frombuffer(bytearray(base64.b64decode(scalars["rng"])), dtype=torch.uint8)
        torch.set_rng_state(state.clone())
    return int(scalars.get("step", 0))
