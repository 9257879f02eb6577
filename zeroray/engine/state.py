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

from zeroray.engine.optim import LossScaler
from zeroray.layout.owners import is_owned_key


def _split(tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(flat tensors in shard coordinates, whole parameters' state: layout/owners.py's keys)."""
    owned = {k: v for k, v in tensors.items() if is_owned_key(k)}
    return {k: v for k, v in tensors.items() if k not in owned}, owned


def export_state(storage, optimizer: Any, step: int, scaler: Optional[LossScaler],
                 live: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Flat fp32 tensors in this rank's shard coordinates, the state of the parameters this rank
    owns whole ([Note: whole-parameter optimizer] in engine/shaped_optim.py), and per-rank
    scalars. ``live``: a tensor may be the engine's own (the master, the optimizer's state)
    where it already is one in those coordinates; the next update changes it (see
    ``Engine.export_state``)."""
    tensors, scalars = optimizer.export_state(live)
    flat, owned = _split(tensors)
    tensors = {**storage.exported(flat), **owned}
    tensors["master"] = storage.master_shard(live)
    scalars["step"] = step
    scalars["scaler"] = scaler.state() if scaler else None
    scalars["rng"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return tensors, scalars


def import_state(storage, optimizer: Any, scaler: Optional[LossScaler],
                 tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> int:
    """Load tensors given in ``storage.state_layout()`` coordinates (and the whole state of the
    parameters this rank owns) into the master and the optimizer, and the scalars; the step
    count to resume at. The caller finishes gathers in flight before and publishes the master after."""
    flat, owned = _split(tensors)
    tensors = {**storage.imported(flat), **owned}
    with torch.no_grad():
        storage.master.copy_(tensors["master"].to(storage.master.device))
    optimizer.import_state({k: v for k, v in tensors.items() if k != "master"}, scalars)
    if scaler is not None and scalars.get("scaler"):
        scaler.load(scalars["scaler"])
    if scalars.get("rng"):
        state = torch.frombuffer(bytearray(base64.b64decode(scalars["rng"])), dtype=torch.uint8)
        torch.set_rng_state(state.clone())
    return int(scalars.get("step", 0))
