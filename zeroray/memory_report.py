"""Measured model-state bytes of one engine, by category, next to the paper's estimate.

Counts the bytes of the tensors the engine holds (not the allocator's view), so the figures
are exact and comparable with zeroray.memory's formulas. See [Note: stage data flow] in
engine.py for which tensors exist at which stage.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from zeroray import memory


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _optimizer_state_bytes(engine) -> int:
    total = 0
    for state in engine.optimizer.inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                total += _nbytes(v)
    return total


def measure(engine) -> Dict[str, Any]:
    zero, layout, fp32 = engine.zero, engine.layout, engine.dtype == torch.float32
    buffers = engine.buffers
    params = _nbytes(buffers.arena) if buffers.persistent else 0
    if engine.param_shard is not None and not (fp32 and engine.param_shard is engine.master):
        params += _nbytes(engine.param_shard)
    if engine.param_shard is not None and fp32 and engine.param_shard is engine.master:
        params += _nbytes(engine.master)  # fp32 stages 1-3: the master *is* the parameter shard
    master = 0 if fp32 else _nbytes(engine.master)
    if fp32 and zero.stage == 0:
        master = 0  # the arena is the master
    grads = _nbytes(engine.grad)
    optim = _optimizer_state_bytes(engine) + master
    stats = engine.coordinator.stats if engine.coordinator is not None else {}
    buckets = engine.reducer.buffer_bytes() + (engine.gatherer.buffer_bytes() if engine.gatherer else 0)
    measured = {"params": params, "grads": grads, "optimizer": optim}
    estimate = expected_model_state(engine)
    return {"stage": zero.stage, "dtype": zero.dtype, "num_workers": engine.world_size,
            "measured": {**measured, "total": sum(measured.values())},
            "estimate": estimate,
            "gathered_params_peak": stats.get("peak_gathered_bytes", 0),
            "bucket_buffers": buckets,
            "activations_peak": getattr(engine, "activation_peak_bytes", None),
            "num_params": layout.numel, "padded_numel": layout.full_numel}


def expected_model_state(engine) -> Dict[str, int]:
    """The paper's per-stage formulas (zeroray.memory), with padding, plus zeroray's documented
    deviations: stages 1-2 keep a local parameter shard as the all-gather source, and the
    reduced gradient (shard, or full at stage 0) is fp32 (reduce target of the optimizer)."""
    zero, layout = engine.zero, engine.layout
    W, padded = engine.world_size, layout.full_numel
    elem = torch.tensor([], dtype=engine.dtype).element_size()
    try:
        k = memory.optimizer_state_bytes_per_param(engine.optimizer_spec, zero.dtype)
    except (ValueError, TypeError):  # a custom callable: count what it actually allocated
        k = _optimizer_state_bytes(engine) // max(engine.master.numel(), 1) + (0 if elem == 4 else 4)
    full_params = elem * padded
    shard = padded // W
    if zero.stage == 0:
        params, grads, optim = full_params, 4 * padded, k * padded
    elif zero.stage in (1, 2):
        params = full_params + elem * shard
        grads, optim = 4 * shard, k * shard
    else:
        params, grads, optim = elem * shard, 4 * shard, k * shard
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
