"""``ZeroConfig(stage="auto")``: the stage chosen for the user's run, before any worker starts.

[Note: stage from the first batch]
A Trainer with ``stage="auto"`` starts no worker until it is first given data (``step``, ``fit``,
``evaluate``; anything else that needs the workers starts them without it, and the log says so):
the stage decides what each worker holds, and what a worker holds at the step's high point
depends on the batch as much as on the model. From the first global batch it takes the rows each
worker computes at once (the batch's rows over ``num_workers x grad_accum_steps``) and the
sequence length (the longest second dimension of the batch's tensors), and with them the plan
sizes activations and logits; ``grad_accum_steps`` adds, at stages 0-1, autograd's full gradient
kept between micro-batches; ``offload`` ("disk") takes the optimizer state, and at stage 3 the
parameter shard, out of memory ([Note: offload on paper] in zeroray/plan/replay.py).

The memory each worker has:
- ``ZeroConfig(memory_budget=B)``: ``B`` bytes for training's tensors (model states, activations,
  buffers, logits: what ``torch.cuda.max_memory_allocated`` counts on a GPU, and on CPU workers
  the tensors ``Trainer.memory_report()`` measures: ``measured`` model states, the gathered
  window, the bucket buffers and the activations), without the CUDA context or the process;
- GPU workers: the device's own memory (``torch.cuda.get_device_properties``, on the driver if it
  has the GPU, else in a one-GPU Ray task), less the CUDA context;
- CPU workers: Ray's free memory shared by the workers, less each worker process's baseline.
A stage fits when its predicted peak is within ``1 - margin`` (80%) of it. The GPU's speed, which
ranks the stages that fit, comes from a preset only when the device's name matches one; any other
GPU gets the conservative "unknown-gpu" figures and a log line ([Note: unknown GPU] in
zeroray/plan/hardware.py). The choice is [Note: choosing a stage] in zeroray/plan/planner.py;
it is logged with the table, and a ValueError says what would fit when nothing does.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional, Tuple

import ray

from zeroray import plan
from zeroray.config import ScalingConfig, ZeroConfig
from zeroray.engine.batch import tensors
from zeroray.plan.hardware import preset_for_device
from zeroray.plan.report import format_plan

log = logging.getLogger("zeroray")

MARGIN = 0.2
DEFAULT_TOKENS = 1024  # the sequence assumed when no batch is known yet


@ray.remote(num_gpus=1)
def _device_properties() -> Tuple[str, int]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return props.name, int(props.total_memory)


def gpu_found() -> Tuple[str, int]:
    """(name, total memory in bytes) of the GPU the workers get: the driver's own first device,
    or where the driver has none, one read in a one-GPU Ray task."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.name, int(props.total_memory)
    return ray.get(_device_properties.remote(), timeout=300)


def gpu_cluster(name: str, total_memory: int, budget: Optional[float]) -> Tuple[plan.Cluster, str]:
    """The plan.Cluster of a GPU called ``name`` with ``total_memory`` bytes ([Note: unknown GPU]), and
    what was assumed about it, for the log."""
    preset = preset_for_device(name)
    memory = {"memory_bytes": float(budget), "context_bytes": 0.0} if budget else {"memory_bytes": float(total_memory)}
    if preset is not None:
        return plan.cluster_preset(preset, **memory), f"GPU {name!r}: the {preset!r} preset's speed"
    return plan.cluster_preset("unknown-gpu", **memory), (
        f"GPU {name!r} is none of zeroray.plan's presets (h100 SXM, h200, v100): its memory "
        f"({total_memory / 1e9:.3g} GB) is read from the device, its speed assumed from the conservative "
        "'unknown-gpu' figures (a modest peak, PCIe-class links), so the ranking of the stages that fit is "
        "rough; set ZeroConfig(stage=0..3) to choose, or compare with `zeroray plan --gpu ...`")


def cluster_found(scaling: ScalingConfig, zero: ZeroConfig) -> Tuple[plan.Cluster, str]:
    """The per-worker hardware of the run as a plan.Cluster, and what it was read from."""
    workers = scaling.num_workers
    budget = zero.memory_budget
    if scaling.use_gpu:
        try:
            name, total = gpu_found()
        except Exception as e:  # noqa: BLE001 - said in the error, with what to do
            raise ValueError(f"stage='auto' with use_gpu=True: could not read the GPU's properties ({type(e).__name__}: "
                             f"{e}); set ZeroConfig(stage=0..3) yourself, or run `zeroray plan` for your GPU") from e
        cluster, how = gpu_cluster(name, total, budget)
        return cluster.with_(gpus_per_node=max(1, min(workers, cluster.gpus_per_node))), how
    cores = float(ray.cluster_resources().get("CPU", workers))  # the workers share them ([Note: hardware presets])
    base = plan.cluster_preset("cpu", gpus_per_node=workers, cores=cores)
    if budget:
        return base.with_(memory_bytes=float(budget), context_bytes=0.0), \
            f"CPU workers: memory_budget {budget / 1e9:.3g} GB each for training's tensors"
    memory = float(ray.available_resources().get("memory", 0.0))
    if memory <= 0:
        raise ValueError("stage='auto': Ray reports no free memory on the cluster; set ZeroConfig(stage=0..3) or "
                         "ZeroConfig(memory_budget=...)")
    return base.with_(memory_bytes=memory / workers), (
        f"CPU workers: Ray's free memory {memory / 1e9:.3g} GB shared by {workers}, less each process's "
        f"{base.context_bytes / 1e9:.2g} GB baseline")


def batch_shape(batch: Any, workers: int, accum: int) -> Optional[Tuple[int, int]]:
    """(rows each worker computes at once, sequence length) of a global batch: its rows over
    ``workers x accum`` (at least 1), and the longest second dimension of its tensors (1 when none
    has two); None for a batch with no tensor."""
    leaves = tensors(batch)
    if not leaves:
        return None
    rows = int(leaves[0].shape[0]) if len(leaves[0].shape) else 1
    seq = max((int(t.shape[1]) for t in leaves if len(t.shape) >= 2), default=1)
    return max(1, rows // (workers * accum)), seq


def resolve_stage(zero: ZeroConfig, model_fn: Callable[[], Any], scaling: ScalingConfig,
                  optimizer: Any, batch: Any = None) -> ZeroConfig:
    """``zero`` unchanged unless its stage is "auto"; then the same config at the stage chosen for
    ``batch`` (the first global batch, or None: not known yet); see [Note: stage from the first batch]."""
    if zero.stage != "auto":
        return zero
    cluster, how = cluster_found(scaling, zero)
    workers, accum = scaling.num_workers, zero.grad_accum_steps
    shape = batch_shape(batch, workers, accum) if batch is not None else None
    if shape is None:
        rows, seq = 1, DEFAULT_TOKENS
        how += (f"; no batch known yet (the workers were needed before any data): activations sized for 1 row of "
                f"{DEFAULT_TOKENS} tokens per worker")
    else:
        rows, seq = shape
    workload = plan.from_module(model_fn, seq_len=seq, wrap=zero.wrap if isinstance(zero.wrap, str) else "auto")
    stage, table, reason = plan.choose_stage(workload, cluster, workers, dtype=zero.dtype, micro_batch=rows,
                                             accum=accum, checkpointing=bool(zero.activation_checkpointing),
                                             margin=MARGIN, optimizer=optimizer, offload=zero.offload,
                                             offload_chunk_bytes=zero.offload_chunk_bytes,
                                             bucket_bytes=zero.base_bucket_bytes, prefetch_bytes=zero.prefetch_bytes)
    log.info("zeroray: stage='auto' -> stage %d: %s (%s)\n%s", stage, reason, how, format_plan(table))
    # the budget was for choosing; the run's config is a plain stage's (the log keeps what was chosen for)
    return dataclasses.replace(zero, stage=stage, memory_budget=None)


def first_batch(data: Any, batch_size: Optional[int] = None) -> Tuple[Any, Any]:
    """(the first global batch of fit's or evaluate's ``data``, or None; the data to use from here on).
    A ``ray.data.Dataset`` gives its first ``batch_size`` rows (``take_batch``); a sequence its first
    element; a one-shot iterator its first batch, and the data returned puts it back in front; any
    other iterable the first batch of a fresh iterator over it."""
    from zeroray.runtime.data_source import is_ray_dataset

    if is_ray_dataset(data):
        if not batch_size:
            return None, data  # fit says what is missing
        import torch

        rows = data.take_batch(batch_size, batch_format="numpy")  # as the workers' local feed reads it
        return {k: torch.as_tensor(v) for k, v in rows.items() if getattr(v, "dtype", object).kind in "biuf"}, data
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return (data[0] if len(data) else None), data
    try:
        it = iter(data)
    except TypeError:
        return None, data  # not iterable: fit and evaluate say so
    first = next(it, None)
    if it is data:  # a one-shot iterator: its first batch is consumed, so hand it back in front
        return first, data if first is None else itertools.chain([first], it)
    return first, data
