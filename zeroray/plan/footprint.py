"""Peak memory of one GPU: model states (the paper's formula, zeroray/memory/model.py), activations,
the gathered window, the gradient buckets, the logits, and a fragmentation slack.

[Note: peak memory]
- model states: ``model_state_bytes`` of the parameters this GPU's tensor-parallel slice holds,
  as the engine holds them (memory/model.py's ``held_state_bytes``, [Note: stage data flow]
  in engine/storage.py): the reduced gradient is fp32 (4 bytes per element, the paper's is 2),
  full at stage 0 and a shard at stages 1-3 (stage 1 reduce-scatters out of the buckets as stage
  2 does); with gradient accumulation, stages 0-1 also hold autograd's full local gradient in
  the compute dtype between micro-batches;
- activations: ``activation_bytes`` of the blocks for one micro-batch (checkpointing: one
  checkpoint per block plus one block's working set), divided by ``tp`` (Megatron splits them);
- stage 3: the prefetch window plus the two units in use; stages 0-2: two gradient buckets
  (one filling, one in flight); stage 1: the gradient is full-size until it is reduced;
- logits: the micro-batch's ``tokens · vocab`` in the compute dtype and fp32 for the loss;
- ``allocated``: the sum of the above, what the allocator hands out at the peak (what
  ``torch.cuda.max_memory_allocated`` reports);
- slack: 10% of the above (allocator fragmentation) plus 1 GB (CUDA context, workspaces).
"""
from __future__ import annotations

from typing import Any, Dict

from zeroray.memory.model import DTYPE_BYTES, activation_bytes, held_state_bytes
from zeroray.plan.workload import Workload

FRAGMENTATION = 0.10
CONTEXT_BYTES = 1e9


def peak_memory(w: Workload, cfg: Any, window: int, bucket_bytes: int) -> Dict[str, float]:
    """[Note: peak memory] for ``cfg`` (a replay.RunConfig) with this window and bucket size."""
    elem = DTYPE_BYTES[cfg.dtype]
    params = -(-w.params // cfg.tp)
    held = held_state_bytes(params, cfg.dp, cfg.stage, cfg.dtype, cfg.optimizer)
    grads = held.grads
    if cfg.accum > 1 and cfg.stage <= 1:
        grads += params * elem
    states = held.params + grads + held.optimizer
    blocks = sum(1 for u in w.units if u.attention)
    act = 0
    if blocks and w.hidden > 1:
        act = activation_bytes(layers=blocks, hidden=w.hidden, seq_len=w.seq_len, batch=cfg.micro_batch,
                               dtype=cfg.dtype, checkpointing=cfg.checkpointing) / cfg.tp
    if cfg.stage == 3:
        buffers = window + 2 * max(u.params for u in w.units) / cfg.tp * elem + 2 * bucket_bytes
    else:
        buffers = 2 * bucket_bytes
    logits = cfg.micro_batch * w.seq_len * w.vocab * (elem + 4) / cfg.tp
    subtotal = states + act + buffers + logits
    slack = FRAGMENTATION * subtotal + CONTEXT_BYTES
    return {"states": float(states), "activations": float(act), "buffers": float(buffers), "logits": float(logits),
            "allocated": float(subtotal), "slack": float(slack), "total": float(subtotal + slack)}
