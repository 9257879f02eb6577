"""``ZeroConfig(stage="auto")``: the stage chosen for the Ray cluster found, before any worker starts.

The cluster is what Ray reports: with ``use_gpu``, the GPUs and their memory (the accelerator type Ray
advertises, mapped to a zeroray.plan preset, or the driver's own CUDA device); without, the host
memory Ray offers shared by the CPU workers. The model is read on the meta device (zeroray.plan's
``from_module``), so choosing costs no memory. The choice is [Note: choosing a stage] in
zeroray/plan/planner.py; it is logged with the table, and a ValueError says what would fit when nothing does.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import ray

from zeroray import plan
from zeroray.config import ScalingConfig, ZeroConfig
from zeroray.plan.report import format_plan

log = logging.getLogger("zeroray")


def cluster_found(scaling: ScalingConfig) -> plan.Cluster:
    """The per-worker hardware of the running Ray cluster as a plan.Cluster."""
    workers = scaling.num_workers
    if scaling.use_gpu:
        kinds = [k.split(":", 1)[1].lower() for k in ray.cluster_resources() if k.startswith("accelerator_type:")]
        for kind in kinds:
            for name in plan.GPU_PRESETS:
                if name.split("-")[0] in kind:
                    return plan.cluster_preset(name)
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return plan.cluster_preset("h100", memory_bytes=float(props.total_memory))
        raise ValueError(f"stage='auto' with use_gpu=True: Ray reports no GPU type zeroray knows ({kinds or 'none'}) "
                         "and the driver sees no CUDA device; set ZeroConfig(stage=0..3) yourself, or run "
                         "`zeroray plan` for your GPU")
    memory = float(ray.available_resources().get("memory", 0.0))
    if memory <= 0:
        raise ValueError("stage='auto': Ray reports no free memory on the cluster; set ZeroConfig(stage=0..3)")
    cores = float(ray.cluster_resources().get("CPU", workers))  # the workers share them ([Note: hardware presets])
    return plan.cluster_preset("cpu", memory_bytes=memory / workers, gpus_per_node=workers, cores=cores)


def resolve_stage(zero: ZeroConfig, model_fn: Callable[[], Any], scaling: ScalingConfig,
                  optimizer: Any) -> ZeroConfig:
    """``zero`` unchanged unless its stage is "auto"; then the same config at the chosen stage."""
    if zero.stage != "auto":
        return zero
    cluster = cluster_found(scaling)
    workload = plan.from_module(model_fn, wrap=zero.wrap if isinstance(zero.wrap, str) else "auto")
    stage, table, reason = plan.choose_stage(workload, cluster, scaling.num_workers, dtype=zero.dtype,
                                             checkpointing=bool(zero.activation_checkpointing), optimizer=optimizer)
    log.info("zeroray: stage='auto' -> stage %d: %s\n%s", stage, reason, format_plan(table))
    return dataclasses.replace(zero, stage=stage)
