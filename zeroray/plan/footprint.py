"""Peak memory of one GPU: model states (the paper's formula, zeroray/memory/model.py), activations,
the gathered window, the gradient buckets, the logits, and a fragmentation slack.

[Note: peak memory]
- model states: ``model_state_bytes`` of the parameters this GPU's tensor-parallel slice holds,
  as the engine holds them (memory/model.py's ``held_state_bytes``, [Note: stage data flow]
  in engine/storage.py): the reduced gradient is fp32 (4 bytes per element, the paper's is 2),
  full at stage 0 and a shard at stages 1-3 (stage 1 reduce-scatters out of the buckets as stage
  2 does); with gradient accumulation, stages 0-1 also hold autograd's full local gradient in
  the compute dtype between micro-batches; with ``offload`` ("disk", or "cpu" on paper: [Note:
  offload on paper] in replay.py) the optimizer term is the tier's three chunks and at stage 3 the
  parameter shard is off the device too. For the rows that compare with the ZeRO paper's own runs
  (tests/plan_published.py), ``states="paper"`` holds them as Table 1's formula does
  (``model_state_bytes``: a 16-bit gradient, full at stages 0-1), and ``states="megatron"`` as the
  paper's plain data-parallel baseline did: Megatron-LM's ``FP16_Optimizer`` (megatron/fp16/fp16.py,
  apex's) copies the fp16 gradients into an fp32 ``.grad`` of each master parameter and keeps it
  between steps (``zero_grad`` zeroes it), 4 bytes per parameter more than the formula;
- activations: ``activation_bytes`` of the blocks for one micro-batch (checkpointing: one
  checkpoint per block plus one block's working set), divided by ``tp`` (Megatron splits them);
- the reducer's pool of bucket buffers (comm/buckets.py): buckets in flight before one waits, one
  where buckets are the configured size, as many as ``bucket_bytes`` holds (at least two) where the
  model is small enough that they are cut smaller, plus the one filling, never more than there are
  buckets; each holds the bucket (all-reduce, stage 0) or its rows and the rank's output row
  (reduce-scatter), and over gloo the exchange's scratch (the peer's bucket with two ranks; W-2 rows
  of the output for a reduce-scatter);
- stage 3: the prefetch window plus the two units in use, never more than the whole model;
- logits: the micro-batch's ``tokens · vocab`` in the compute dtype and fp32 for the loss;
- ``allocated``: the sum of the above, what the allocator hands out at the peak (what
  ``torch.cuda.max_memory_allocated`` reports);
- slack: 10% of the above (allocator fragmentation) plus the cluster's ``context_bytes``: on a GPU
  1 GB (CUDA context, workspaces); on CPU workers the worker process's baseline (Python, torch, Ray).
  A memory budget given to ``stage="auto"`` counts training's tensors only: its cluster has no
  context (runtime/auto_stage.py).
"""
from __future__ import annotations

from typing import Any, Dict

from zeroray.memory.model import DTYPE_BYTES, ModelStateBytes, activation_bytes, held_state_bytes, model_state_bytes
from zeroray.plan.workload import Workload

FRAGMENTATION = 0.10


def reduce_pool_bytes(bucket: int, buckets: int, bucket_bytes: int, stage: int, dp: int, gloo: bool) -> float:
    """The reducer's pooled buffers at the step's peak ([Note: peak memory]): ``bucket`` bytes a bucket
    (its full rows), ``buckets`` buckets in the plan, ``bucket_bytes`` the configured size."""
    if dp <= 1 or not buckets:
        return 0.0
    in_flight = max(bucket_bytes // bucket, 2) if bucket < bucket_bytes else 1
    pool = min(buckets, in_flight + 1)
    if stage == 0:
        per = bucket * (2 if gloo and dp == 2 else 1)
    else:
        per = bucket * (1 + 1 / dp + (max(dp - 2, 0) / dp if gloo else 0))
    return pool * per


def peak_memory(w: Workload, cfg: Any, window: int, bucket_bytes: int, context_bytes: float, buckets: int = 2,
                gloo: bool = False) -> Dict[str, float]:
    """[Note: peak memory] for ``cfg`` (a replay.RunConfig) with this window, buckets of ``bucket_bytes``
    (``buckets`` of them in the plan) and, with ``gloo``, the exchange's scratch."""
    elem = DTYPE_BYTES[cfg.dtype]
    params = -(-w.params // cfg.tp)
    chunk = cfg.offload_chunk_bytes if cfg.offload is not None else None
    if cfg.states != "zeroray":
        held = model_state_bytes(params, cfg.dp, cfg.stage, cfg.dtype, cfg.optimizer)
        if cfg.states == "megatron":  # the master's fp32 gradient, beside the model's 16-bit one
            held = ModelStateBytes(held.params, held.grads + 4 * (params if cfg.stage == 0 else -(-params // cfg.dp)),
                                   held.optimizer)
        if chunk is not None:
            raise ValueError(f"states={cfg.states!r} with offload: the paper's runs had none; use states='zeroray'")
    else:
        held = held_state_bytes(params, cfg.dp, cfg.stage, cfg.dtype, cfg.optimizer, offload_chunk_bytes=chunk)
    grads = held.grads
    if cfg.accum > 1 and cfg.stage <= 1 and cfg.states == "zeroray":
        grads += params * elem
    states = held.params + grads + held.optimizer
    blocks = sum(1 for u in w.units if u.attention)
    act = 0
    if blocks and w.hidden > 1:
        act = activation_bytes(layers=blocks, hidden=w.hidden, seq_len=w.seq_len, batch=cfg.micro_batch,
                               dtype=cfg.dtype, checkpointing=cfg.checkpointing) / cfg.tp
    buffers = reduce_pool_bytes(bucket_bytes, buckets, cfg.bucket_bytes, cfg.stage, cfg.dp, gloo)
    if cfg.stage == 3:
        buffers += min(window + 2 * max(u.params for u in w.units) / cfg.tp * elem, params * elem)
    logits = cfg.micro_batch * w.seq_len * w.vocab * (elem + 4) / cfg.tp
    subtotal = states + act + buffers + logits
    slack = FRAGMENTATION * subtotal + context_bytes
    return {"states": float(states), "activations": float(act), "buffers": float(buffers), "logits": float(logits),
            "allocated": float(subtotal), "slack": float(slack), "total": float(subtotal + slack)}
