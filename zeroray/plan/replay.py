"""Replay one optimizer step of one worker on a compute stream and a communication stream.

[Note: step replay]
The host issues work in order; ``t`` is when the compute stream is free, ``c`` when the
communication stream is. A collective launched at host time ``t`` costs ``launch_s`` of host
time (the compute stream waits for it: the launch is on the same thread) and runs on the comm
stream from ``max(c, t)`` for its ring cost ([Note: ring costs]). Compute waits for the gathers
it needs. What each stage issues is the engine's:

- stage 3: the engine's own ``Schedule.build`` (fetch/trace.py) over a synthesised trace, one
  FORWARD/END per unit, then BACKWARD per unit in reverse: its on-demand and prefetch gathers
  (prefetch window ``prefetch_bytes``), every micro-batch;
- stages 1-2: the step's updated parameters are published by all-gathers issued at the start of
  the next step, overlapped with the first forward, which waits for each unit's;
- gradients leave in the engine's buckets (comm/bucket_plan.py's ``pack`` and
  ``fixed_capacity``), each launched when its last unit's backward is done: an all-reduce at
  stage 0 and a reduce-scatter at stages 1-3; stages 0-1 reduce only on the last micro-batch
  (gradients accumulate whole), stages 2-3 on every micro-batch;
- each gradient is copied into its bucket in the reduce dtype (``reduce_dtype``, fp32 by default,
  as the engine's ``ZeroConfig.reduce_dtype``), a memory-bound copy on the compute stream;
- the optimizer step waits for the comm stream and streams master weights, state, gradient and
  parameter through ``hbm_bw`` (about 30 bytes per local element with Adam);
- ``step_overhead_s``: the host's fixed cost of a step outside the replay (the runtime's call into
  the workers, the step's status all-reduce), measured per cluster.

Workers that share CPU cores (``Cluster.cores``: the CPU preset) share them: compute, copies, the
optimizer and launches of each run ``core_share`` times slower when a node has more workers than
cores, and when they have every core busy (``saturated``) a collective overlaps the compute only
in the measured share ``Cluster.busy_overlap``: gloo over loopback TCP moves its bytes with the
same cores' copies, so the compute stream waits for the rest ([Note: hardware presets]). With more than one rank, the compute runs at the
slowest rank's pace (``Cluster.straggler``): the ranks meet at every collective.

Backward costs twice the forward plus the recomputed share of it (``recompute``: 1 with
activation checkpointing, 0 without; a selective policy recomputes a part, e.g. torchtitan's
every-second-matmul).

[Note: offload on paper]
``offload`` is ``ZeroConfig.offload``. "disk" is the engine's disk tier ([Note: disk offload] in
offload/stepper.py): the optimizer state, and in mixed precision or at stage 3 the fp32 master (at
stage 3 the parameter shard too), are in files; memory holds three chunks of them
(memory/model.py's ``held_state_bytes``), and every step reads and writes each file's part of the
shard once, overlapped with the stepping, so the optimizer takes the longer of its own pass and
that I/O at the cluster's ``disk_bw``. "cpu" is the host-memory tier of a GPU worker, which the
engine does not have yet (``ZeroConfig`` refuses it): the plan predicts it on paper as the disk
tier's layout in host memory, its I/O over the host link (``host_bw`` each way, reads and
writes at once). Neither time is checked against a measurement (benchmarks/plan_check.py checks
the disk tier's memory against fits.py's largest models); the stage-3 shard's reads ahead of
the gathers are taken as hidden behind compute, as the engine's measured 85-95% of them are
(benchmarks/README.md).

Tensor parallelism (``tp``, Megatron inside a node, for the paper's ZeRO-100B runs) divides a
block's FLOPs and parameters by ``tp`` and adds two activation all-reduces per block in forward,
two in backward and two more in recomputation, not overlapped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from zeroray.comm import bucket_plan
from zeroray.fetch.trace import EventKind, Schedule
from zeroray.memory.model import DTYPE_BYTES, offload_files, optimizer_state_bytes_per_param
from zeroray.plan.costs import dp_ring, tp_ring
from zeroray.plan.footprint import peak_memory
from zeroray.plan.hardware import Cluster
from zeroray.plan.workload import Workload

MiB = 2**20
OFFLOAD_TIERS = (None, "disk", "cpu")
STATES = ("zeroray", "paper", "megatron")


@dataclass(frozen=True)
class RunConfig:
    stage: int
    gpus: int
    micro_batch: int = 1          # sequences per micro-batch per data-parallel rank
    accum: int = 1
    dtype: str = "bf16"
    bucket_bytes: int = 16 * MiB  # the engine's default
    prefetch_bytes: Optional[int] = None  # stage 3 window; None: the engine's (largest unit, at least a bucket)
    checkpointing: bool = True
    tp: int = 1
    optimizer: str = "adam"
    reduce_dtype: str = "fp32"    # the dtype gradients are bucketed and reduced in (the engine's default: fp32)
    recompute: Optional[float] = None  # share of the forward recomputed in backward; None: 1 with checkpointing
    offload: Optional[str] = None  # ZeroConfig.offload: None, "disk", or "cpu" (on paper: [Note: offload on paper])
    offload_chunk_bytes: int = 16 * MiB  # ZeroConfig.offload_chunk_bytes
    states: str = "zeroray"       # model states as held by: zeroray's engine, "paper" or "megatron" ([Note: peak memory])

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is invalid: choose 0, 1, 2 or 3")
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise ValueError(f"gpus={self.gpus} and tp={self.tp} are invalid: gpus must be a positive multiple of tp")
        for name in ("dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: choose one of {tuple(DTYPE_BYTES)}")
        if self.offload not in OFFLOAD_TIERS:
            raise ValueError(f"offload={self.offload!r} is invalid: choose None, 'disk' or 'cpu'")
        if self.states not in STATES:
            raise ValueError(f"states={self.states!r} is invalid: 'zeroray' (the engine's fp32 gradient, a shard from "
                             "stage 1), 'paper' (Table 1's formula: a 16-bit gradient, full at stages 0-1) or "
                             "'megatron' (the paper's baseline: Table 1's plus an fp32 gradient of the fp32 master)")
        if self.recompute is not None and not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"recompute={self.recompute!r} is invalid: it is the share of the forward recomputed in "
                             "backward, between 0 and 1 (or None: 1 with checkpointing, 0 without)")

    @property
    def dp(self) -> int:
        return self.gpus // self.tp


@dataclass
class StepReport:
    stage: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    host_s: float
    optimizer_s: float
    tokens_per_s: float           # all GPUs together
    tokens_per_s_per_gpu: float
    mfu: float
    memory: Dict[str, float] = field(default_factory=dict)
    collectives: int = 0

    @property
    def peak_bytes(self) -> float:
        return self.memory["total"]


def window_bytes(w: Workload, cfg: RunConfig) -> int:
    """The stage-3 prefetch window in bytes: ``prefetch_bytes``, or the engine's default
    (fetch/unit_fetcher.py): the largest unit, never less than one coalescing bucket."""
    if cfg.prefetch_bytes is not None:
        return cfg.prefetch_bytes
    return max(max(u.params for u in w.units) // cfg.tp * DTYPE_BYTES[cfg.dtype], cfg.bucket_bytes)


def simulate(w: Workload, cluster: Cluster, cfg: RunConfig) -> StepReport:
    """One step of one worker; see [Note: step replay]."""
    elem = DTYPE_BYTES[cfg.dtype]
    tokens = cfg.micro_batch * w.seq_len
    peak = cluster.peak_flops * (1.0 if elem == 2 else cluster.fp32_ratio)
    share = cluster.core_share(min(cfg.gpus, cluster.gpus_per_node))
    # ranks that meet at collectives step at the slowest one's pace; one rank waits for no one
    rate = peak * cluster.efficiency(tokens) / share / (cluster.straggler if cfg.gpus > 1 else 1.0)
    recompute = cfg.recompute if cfg.recompute is not None else (1.0 if cfg.checkpointing else 0.0)
    fwd = [w.unit_flops_per_token(u) / 3 * tokens / cfg.tp / rate for u in w.units]
    bwd = [2 * f + recompute * f for f in fwd]
    ring, tpr = dp_ring(cluster, cfg.dp, cfg.tp), tp_ring(cluster, cfg.tp)
    tp_ar = tpr.all_reduce(tokens * w.hidden * elem) if cfg.tp > 1 else 0.0
    blocks = [u.attention for u in w.units]
    unit_bytes = [max(1, u.params // cfg.tp) * elem for u in w.units]
    n = len(w.units)
    launch = cluster.launch_s * share
    saturated = cluster.saturated(min(cfg.gpus, cluster.gpus_per_node))
    state = {"t": 0.0, "c": 0.0, "host": 0.0, "count": 0, "copy": 0.0}

    def issue(seconds: float) -> float:
        state["t"] += launch
        state["host"] += launch
        state["count"] += 1
        state["c"] = max(state["c"], state["t"]) + seconds
        if saturated:  # the transfer's copies take the cores the compute would have used, but the measured share
            state["t"] += (1.0 - cluster.busy_overlap) * (state["c"] - state["t"])
        return state["c"]

    def run(seconds: float) -> None:
        state["t"] += seconds

    # Gradient buckets: the engine's pack, in backward order, of its fixed capacity, in the reduce dtype.
    grad_elem = DTYPE_BYTES[cfg.reduce_dtype]
    # Each gradient is copied into its bucket when it is reduced: read in the compute dtype, written
    # in the reduce dtype, on the compute stream.
    copy_s = [u.params / cfg.tp * (elem + grad_elem) / cluster.hbm_bw * share for u in w.units]
    model_bytes = sum(unit_bytes) // elem * grad_elem
    capacity = max(1, bucket_plan.fixed_capacity(cfg.bucket_bytes, model_bytes) // grad_elem)
    order = list(range(n - 1, -1, -1))
    specs = bucket_plan.pack(order, {u: unit_bytes[u] // elem for u in range(n)}, capacity,
                             first=bucket_plan.FIRST_BUCKET_BYTES // grad_elem)
    last_unit_of = {}  # unit -> buckets that launch once its backward is done
    for spec in specs:
        last_unit_of.setdefault(spec.pieces[-1].unit, []).append(spec.row_numel * grad_elem)

    def reduce_after(u: int, micro: int) -> None:
        last_micro = micro == cfg.accum - 1
        if cfg.stage <= 1 and not last_micro:
            return  # autograd accumulates the full gradient; it reaches the buckets on the last micro-batch
        run(copy_s[u])
        state["copy"] += copy_s[u]
        for nbytes in last_unit_of.get(u, ()):
            issue(ring.all_reduce(nbytes) if cfg.stage == 0 else ring.reduce_scatter(nbytes))

    schedule = _stage3_schedule(n, unit_bytes, cfg, window_bytes(w, cfg)) if cfg.stage == 3 else None
    ready: Dict[int, float] = {}
    if cfg.stage in (1, 2) and cfg.dp > 1:  # the previous step's publish, overlapped with this forward
        for group in _coalesce(list(range(n)), unit_bytes, cfg.bucket_bytes):
            end = issue(ring.all_gather(sum(unit_bytes[u] for u in group)))
            ready.update({u: end for u in group})
    for micro in range(cfg.accum):
        if schedule is None:
            for u in range(n):
                state["t"] = max(state["t"], ready.get(u, 0.0))
                run(fwd[u] + (2 * tp_ar if blocks[u] else 0.0))
            for u in order:
                run(bwd[u] + ((2 + 2 * recompute) * tp_ar if blocks[u] else 0.0))
                reduce_after(u, micro)
            continue
        ready = {}
        for (kind, index), pos in zip(schedule.events, schedule.positions):
            for group in pos.on_demand:
                end = issue(ring.all_gather(sum(unit_bytes[u] for u in group)))
                ready.update({u: end for u in group})
            for u in pos.needs:
                state["t"] = max(state["t"], ready.get(u, 0.0))
            for group in pos.prefetch:
                end = issue(ring.all_gather(sum(unit_bytes[u] for u in group)))
                ready.update({u: end for u in group})
            if kind is EventKind.FORWARD:
                run(fwd[index] + (2 * tp_ar if blocks[index] else 0.0))
            elif kind is EventKind.BACKWARD:
                run(bwd[index] + ((2 + 2 * recompute) * tp_ar if blocks[index] else 0.0))
                reduce_after(index, micro)
    state["t"] = max(state["t"], state["c"])
    local = w.params / cfg.tp / (1 if cfg.stage == 0 else cfg.dp)
    k = optimizer_state_bytes_per_param(cfg.optimizer, cfg.dtype)
    opt_s = local * (2 * k + 4 + elem) / cluster.hbm_bw * share  # read+write master and state, read grad, write param
    if cfg.offload is not None:  # [Note: offload on paper]: the tier's reads and writes, overlapped with the stepping
        io = 2 * 4 * offload_files(cfg.dtype, cfg.optimizer, cfg.stage) * local
        opt_s = max(opt_s, io / (cluster.disk_bw if cfg.offload == "disk" else 2 * cluster.host_bw))
    step = state["t"] + opt_s + cluster.step_overhead_s
    compute = cfg.accum * (sum(fwd) + sum(bwd))
    step_tokens = cfg.dp * cfg.accum * tokens
    tps = step_tokens / step
    mfu = w.flops_per_token * tps / (cluster.peak_flops * cfg.gpus)
    exposed = max(0.0, state["t"] - compute - state["host"] - state["copy"])
    mem = peak_memory(w, cfg, window_bytes(w, cfg), capacity * grad_elem, cluster.context_bytes, buckets=len(specs),
                      gloo=cluster.cores > 0)
    return StepReport(cfg.stage, step, compute, exposed, state["host"], opt_s, tps, tps / cfg.gpus, mfu, mem,
                      state["count"])


def _coalesce(units: List[int], unit_bytes: List[int], bound: int) -> List[List[int]]:
    """Consecutive units into gathers of at most ``bound`` bytes, a unit of ``bound`` or more alone
    (comm/gather.py's ``coalesce``)."""
    groups: List[List[int]] = []
    size = 0
    for u in units:
        if groups and size + unit_bytes[u] <= bound and unit_bytes[u] < bound:
            groups[-1].append(u)
            size += unit_bytes[u]
        else:
            groups.append([u])
            size = unit_bytes[u]
    return groups


def _stage3_schedule(n: int, unit_bytes: List[int], cfg: RunConfig, window: int) -> Schedule:
    """The engine's Schedule over a synthesised trace: FORWARD/END per unit, then BACKWARD per unit in reverse."""
    events: List[Tuple[EventKind, int]] = []
    for u in range(n):
        events += [(EventKind.FORWARD, u), (EventKind.END, u)]
    events.append((EventKind.BACKWARD_START, 0))
    events += [(EventKind.BACKWARD, u) for u in range(n - 1, -1, -1)]
    return Schedule.build(events, [(u,) for u in range(n)], unit_bytes,
                          lambda units: _coalesce(units, unit_bytes, cfg.bucket_bytes),
                          prefetch=window > 0, prefetch_bytes=window, max_live_bytes=sum(unit_bytes),
                          reuse_distance=2)  # the engine's defaults: no bound of its own on live bytes
