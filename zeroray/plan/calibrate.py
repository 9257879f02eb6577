"""A CPU machine as a ``Cluster``, from what was measured on it; see [Note: CPU calibration].

[Note: CPU calibration]
Every figure of a CPU cluster comes from a measurement on that machine (benchmarks/plan_measure.py
takes them, benchmarks/plan_check.py feeds them here), never from the rows it is checked against:

- gloo's ring (``gloo_ring``): latency per hop and bus bandwidth, a least-squares line through the
  point-to-point exchange's all-gather and reduce-scatter times against the bytes each rank moves;
- the optimizer's memory bandwidth (``hbm_bw``): the flat fused AdamW step's bytes over its time;
- the compute (``achieved``): the single-process step of one worker's batch on one thread, scaled by
  two ratios each taken at the same moments (so that the background load of those moments cancels):

  * ``engine_ratio``: the engine's own single-process step (stage 0, no peer: its hooks, the
    gradient copies into the buckets, its bookkeeping) over the plain PyTorch step. The engine's
    in-process work runs on the worker's thread like the model's, so it time-shares the cores as
    the compute does (and the replay's gradient copies, part of it, are taken out again);
  * ``contention`` (``contended``): ``W`` copies of the plain step started together, one per worker,
    over each copy alone: workers that share a machine share its caches and memory bandwidth, and
    ``W`` one-thread workers on ``C < W`` cores also share the cores. The replay holds the ideal
    share ``W / C`` (``Cluster.core_share``); what the copies lose beyond it (the scheduler moving
    and interleaving three threads on two cores, their caches refilled after every switch) is the
    measured remainder;

- ``straggler`` (``contended``): the slowest of those ``W`` copies per step over their median, the
  pace of ranks that meet at every step's collectives.

A measurement with only one copy per core (taken before the copies per worker were) is read with
``W = C`` copies for every world size, and says so; so is one whose copies per worker waited for a
core longer than their own sharing explains (``undisturbed``): other processes held the cores.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from zeroray.memory.model import optimizer_state_bytes_per_param
from zeroray.plan.hardware import Cluster, cluster_preset
from zeroray.plan.replay import RunConfig, simulate
from zeroray.plan.workload import Workload


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics; 0.5 is the median)."""
    if not xs:
        raise ValueError("quantile of no measurements: the measurement has an empty list of step times")
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def gloo_ring(rows: List[dict], world: int) -> Tuple[float, float]:
    """(latency per hop, bus bandwidth) of the exchange's ring at ``world`` ranks: a least-squares
    line through collectives.py's all-gather and reduce-scatter times (median ms of rank 0) against
    the bytes each rank moves, ``(W-1)/W`` of the full tensor ([Note: ring costs])."""
    pts = [((world - 1) / world * r["mb"] * 1e6, r[k] / 1e3) for r in rows if r["world"] == world
           for k in ("all_gather exchange", "reduce_scatter exchange")]
    if len(pts) < 2:
        raise ValueError(f"gloo has {len(pts)} timings at world {world}: the measurement needs collectives.py's rows "
                         "at that world size (re-measure with it in --workers)")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    slope = max(slope, 1e-12)
    alpha = max(my - slope * mx, 0.0)
    return alpha / (world - 1), 1.0 / slope


def contended_figures(together_s: float, alone_s: float, slowest_s: float, copies: int, cores: float
                      ) -> Tuple[float, float]:
    """(contention, straggler) of ``copies`` one-thread copies of a step started together on
    ``cores`` cores: the together/alone ratio over the ideal share ``copies / cores`` that the
    replay already holds (``Cluster.core_share``), as measured (under 1 too: nothing measured
    says when that is the alone half's disturbance rather than the copies' own pace), and the
    slowest copy over the median one (at least 1: ``Cluster.straggler``; the slowest of a step's
    copies is never faster than the step's others, so only the quantiles' interpolation can
    bring it under 1)."""
    if min(together_s, alone_s, slowest_s) <= 0 or copies < 1 or cores <= 0:
        raise ValueError(f"contended floor times {together_s}, {alone_s}, {slowest_s} s with {copies} copies on "
                         f"{cores} cores: every time and count must be positive")
    share = max(1.0, copies / cores)
    return together_s / alone_s / share, max(1.0, slowest_s / together_s)


def undisturbed(wall_s: float, cpu_s: float, copies: int, cores: float) -> bool:
    """Whether ``copies`` one-thread copies run together on ``cores`` cores waited for a core no longer
    than their own sharing explains: a fair scheduler gives each at least ``1 / ceil(copies / cores)``
    of a core, so a copy's wall time is at most ``ceil(copies / cores)`` times its CPU seconds. Longer,
    and other processes held the cores: the measurement says nothing about the copies."""
    if wall_s <= 0 or cpu_s <= 0:
        raise ValueError(f"wall_s={wall_s} and cpu_s={cpu_s} are invalid: both are measured times, > 0")
    return wall_s <= -(-copies // max(1, int(cores))) * cpu_s


def engine_ratio(engine_steps_s: Sequence[float], fwd_bwd_s: Sequence[float], adamw_s: Sequence[float],
                 q: float = 0.5) -> float:
    """The engine's single-process step less its AdamW over the plain forward+backward, step by step
    (each engine step beside the plain step taken right after it), at quantile ``q`` over steps."""
    if not (len(engine_steps_s) == len(fwd_bwd_s) == len(adamw_s)) or not engine_steps_s:
        raise ValueError(f"engine_solo has {len(engine_steps_s)} engine steps, {len(fwd_bwd_s)} forward+backward and "
                         f"{len(adamw_s)} AdamW times: it needs one of each per step (re-measure it)")
    return quantile([(e - a) / f for e, f, a in zip(engine_steps_s, fwd_bwd_s, adamw_s)], q)


def cpu_cluster(workload: Workload, gloo_rows: List[dict], world: int, cores: float, *, step_s: float,
                adamw_s: float, params: int, micro_batch: int, straggler: float = 1.0, engine: bool = True) -> Cluster:
    """This machine as a ``Cluster`` for ``world`` workers ([Note: CPU calibration]): the ring from
    gloo's α–β at that world size, ``hbm_bw`` from the flat AdamW step of ``params`` fp32 parameters
    (``adamw_s``), ``achieved`` from ``step_s``, one worker's single-process step less its AdamW,
    and ``straggler``. ``engine``: ``step_s`` is the engine's, so it holds the gradient copies the
    replay adds (they are taken out of it); else it is the plain PyTorch forward+backward."""
    if step_s <= 0 or adamw_s <= 0:
        raise ValueError(f"step_s={step_s} and adamw_s={adamw_s} are invalid: both are measured times, > 0")
    lat, bw = gloo_ring(gloo_rows, world)
    base = cluster_preset("cpu", gpus_per_node=world, cores=cores, intra_bw=bw, intra_lat=lat, inter_bw=bw,
                          inter_lat=lat, launch_s=0.0, half_tokens=1e-9)
    k = optimizer_state_bytes_per_param("adamw", "fp32")
    hbm = params * (2 * k + 4 + 4) / adamw_s
    probe = simulate(workload, base.with_(hbm_bw=hbm), RunConfig(0, 1, micro_batch=micro_batch, dtype="fp32",
                                                                 checkpointing=False, optimizer="adamw"))
    # one worker, no peer: all the replay adds to its compute and optimizer is the gradient copies
    copies = probe.step_s - probe.compute_s - probe.optimizer_s if engine else 0.0
    if step_s <= copies:
        raise ValueError(f"step_s={step_s} s is no more than the replay's gradient copies ({copies} s): the "
                         "measured step cannot be this model's; check the measurement's model sizes")
    achieved = base.achieved * probe.compute_s / (step_s - copies)
    return base.with_(achieved=achieved, hbm_bw=hbm, straggler=straggler)
