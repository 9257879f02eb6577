"""``plan``: the table per stage, the recommended bucket and window, the largest model per stage,
and ``choose_stage`` for ``ZeroConfig(stage="auto")``.

[Note: choosing a stage]
A stage *fits* when its predicted peak ([Note: peak memory] in footprint.py) is at most
``(1 - margin)`` of the memory per GPU. The cheapest stage is the one with the shortest predicted
step among those that fit; a higher stage must be more than ``TIE`` faster to win over a lower one,
since the lower one is the simpler run (fewer collectives, no fetch schedule). When no stage fits,
the error says how much memory the best stage needs and what fits instead (more workers, a smaller
model, activation checkpointing, bf16).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from zeroray.plan.hardware import Cluster
from zeroray.plan.replay import MiB, RunConfig, StepReport, simulate, window_bytes
from zeroray.plan.workload import Workload, from_params

STAGES = (0, 1, 2, 3)
TIE = 0.03
BUCKETS = (4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
WINDOW_BLOCKS = (1, 2, 4)


def _fits(report: StepReport, cluster: Cluster, margin: float) -> bool:
    return report.peak_bytes <= (1.0 - margin) * cluster.memory_bytes


def best_for_stage(w: Workload, cluster: Cluster, cfg: RunConfig, margin: float = 0.0,
                   fixed: bool = False) -> StepReport:
    """The recommended bucket size (and stage-3 window) for ``cfg.stage``: the fastest that fits,
    or the fastest when none does (its row then says it does not fit). ``fixed``: ``cfg``'s own
    bucket size and window (the run's, for ``stage="auto"``), no search."""
    block = max(u.params for u in w.units) // cfg.tp * (2 if cfg.dtype != "fp32" else 4)
    windows = [k * block for k in WINDOW_BLOCKS] if cfg.stage == 3 and cfg.prefetch_bytes is None else [cfg.prefetch_bytes]
    if fixed:
        windows = [cfg.prefetch_bytes]
    best: Optional[Tuple[Tuple[int, float], StepReport, RunConfig]] = None
    for bucket in ([cfg.bucket_bytes] if fixed else BUCKETS):
        for window in windows:
            c = replace(cfg, bucket_bytes=bucket, prefetch_bytes=window)
            r = simulate(w, cluster, c)
            key = (0 if _fits(r, cluster, margin) else 1, r.step_s)
            if best is None or key < best[0]:
                best = (key, r, c)
    assert best is not None
    _, report, chosen = best
    report.memory["bucket_bytes"] = chosen.bucket_bytes
    report.memory["prefetch_bytes"] = window_bytes(w, chosen) if chosen.stage == 3 else 0
    return report


def max_micro_batch(w: Workload, cluster: Cluster, cfg: RunConfig, margin: float = 0.0, limit: int = 64) -> int:
    """The largest power-of-two micro-batch (<= limit) whose step fits; 0 when even 1 does not."""
    best, mb = 0, 1
    while mb <= limit:
        if not _fits(simulate(w, cluster, replace(cfg, micro_batch=mb)), cluster, margin):
            break
        best, mb = mb, mb * 2
    return best


def plan(w: Workload, cluster: Cluster, gpus: int, *, dtype: str = "bf16", micro_batch: int = 1, accum: int = 1,
         tp: int = 1, checkpointing: bool = True, margin: float = 0.1, optimizer: str = "adam",
         largest: bool = True, fixed: bool = False, **run: Any) -> Dict[str, Any]:
    """Every stage of ``w`` on ``gpus`` GPUs of ``cluster``: memory, fits, step time, tokens/s, MFU and the
    recommended bucket and window; the largest model per stage; and the cheapest stage that fits.
    ``run``: further RunConfig fields (``offload``, ``offload_chunk_bytes``, ``reduce_dtype``,
    ``bucket_bytes``, ``prefetch_bytes``); ``fixed``: those bucket and window, not the recommended ones."""
    rows: Dict[str, Any] = {}
    for stage in STAGES:
        cfg = RunConfig(stage, gpus, micro_batch, accum, dtype, checkpointing=checkpointing, tp=tp, optimizer=optimizer,
                        **run)
        r = best_for_stage(w, cluster, cfg, margin, fixed)
        rows[str(stage)] = {
            "memory_gb": r.peak_bytes / 1e9, "fits": _fits(r, cluster, margin), "step_s": r.step_s,
            "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "exposed_comm_s": r.exposed_comm_s,
            "bucket_mib": r.memory["bucket_bytes"] / MiB, "window_mib": r.memory["prefetch_bytes"] / MiB,
            "collectives": r.collectives, "memory": {k: v / 1e9 for k, v in r.memory.items()
                                                      if k not in ("bucket_bytes", "prefetch_bytes")},
        }
    out: Dict[str, Any] = {"model": w.name, "params": w.params, "seq_len": w.seq_len, "gpus": gpus,
                           "gpu": cluster.name, "gpu_memory_gb": cluster.memory_bytes / 1e9, "dtype": dtype,
                           "micro_batch": micro_batch, "accum": accum, "tp": tp, "margin": margin,
                           "offload": run.get("offload"), "stages": rows}
    fitting = [int(s) for s, row in rows.items() if row["fits"]]
    out["recommended"] = _cheapest(rows, fitting)
    if largest:
        out["largest"] = largest_models(cluster, gpus, dtype=dtype, seq_len=w.seq_len, micro_batch=micro_batch,
                                        tp=tp, checkpointing=checkpointing, margin=margin, optimizer=optimizer,
                                        **{k: v for k, v in run.items() if k not in ("bucket_bytes", "prefetch_bytes")})
    return out


def count(n: float) -> str:
    """A parameter count as people write it: 6.74B, 350M, 217."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _cheapest(rows: Dict[str, Any], fitting: List[int]) -> Optional[int]:
    best: Optional[int] = None
    for s in sorted(fitting):
        if best is None or rows[str(s)]["step_s"] < (1 - TIE) * rows[str(best)]["step_s"]:
            best = s
    return best


def largest_models(cluster: Cluster, gpus: int, *, dtype: str = "fp16", seq_len: int = 1024, micro_batch: int = 1,
                   tp: int = 1, checkpointing: bool = True, margin: float = 0.0,
                   optimizer: str = "adam", **run: Any) -> Dict[str, int]:
    """Per stage, the largest GPT-shaped model (workload.from_params) whose peak fits, to 1%. ``run``:
    further RunConfig fields (``offload``, ``states``, ``reduce_dtype``)."""
    out: Dict[str, int] = {}
    for stage in STAGES:
        cfg = RunConfig(stage, gpus, micro_batch, 1, dtype, checkpointing=checkpointing, tp=tp, optimizer=optimizer,
                        **run)

        def fits(n: float) -> bool:
            return _fits(simulate(from_params(n, seq_len=seq_len), cluster, cfg), cluster, margin)

        lo, hi = 1e6, 1e6
        if not fits(lo):
            out[str(stage)] = 0
            continue
        while fits(hi) and hi < 1e15:
            lo, hi = hi, hi * 2
        while hi / lo > 1.01:
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        out[str(stage)] = int(from_params(lo, seq_len=seq_len).params)
    return out


def choose_stage(w: Workload, cluster: Cluster, gpus: int, *, dtype: str = "bf16", micro_batch: int = 1,
                 accum: int = 1, checkpointing: bool = False, margin: float = 0.2, optimizer: str = "adam",
                 **run: Any) -> Tuple[int, Dict[str, Any], str]:
    """(stage, plan table, reason) for ``stage="auto"``; ValueError when no stage fits ([Note: choosing a
    stage]), at the run's own bucket size and window. ``run``: further RunConfig fields (``offload``,
    ``offload_chunk_bytes``, ``bucket_bytes``, ``prefetch_bytes``)."""
    table = plan(w, cluster, gpus, dtype=dtype, micro_batch=micro_batch, accum=accum, checkpointing=checkpointing,
                 margin=margin, optimizer=optimizer, largest=False, fixed=True, **run)
    rows = table["stages"]
    stage = table["recommended"]
    budget = (1 - margin) * cluster.memory_bytes / 1e9
    shape = f"micro-batch {micro_batch} x {w.seq_len} tokens" + (f" x {accum} accumulated" if accum > 1 else "")
    if run.get("offload"):
        shape += f", offload={run['offload']!r}"
    if stage is None:
        need = min(rows.values(), key=lambda r: r["memory_gb"])["memory_gb"]
        more = _workers_needed(w, cluster, gpus, dtype, micro_batch, checkpointing, margin, optimizer, run)
        plain = {k: v for k, v in run.items() if k not in ("bucket_bytes", "prefetch_bytes")}
        fit = largest_models(cluster, gpus, dtype=dtype, seq_len=w.seq_len, micro_batch=micro_batch,
                             checkpointing=checkpointing, margin=margin, optimizer=optimizer, **plain)["3"]
        raise ValueError(
            f"stage='auto': no ZeRO stage fits {count(w.params)} parameters ({shape}) on {gpus} worker(s) with "
            f"{cluster.memory_bytes / 1e9:.3g} GB each (budget {budget:.3g} GB after a {margin:.0%} margin): the "
            f"smallest footprint is {need:.3g} GB. What fits: about {count(fit)} parameters at stage 3 "
            f"on {gpus} worker(s)" + (f", or this model on {more} workers" if more else "") +
            "; or turn on activation_checkpointing, use dtype='bf16', offload='disk', or a smaller batch per worker")
    others = ", ".join(f"stage {s}: {r['memory_gb']:.3g} GB {'fits' if r['fits'] else 'does not fit'}, "
                       f"{r['step_s'] * 1e3:.3g} ms" for s, r in rows.items())
    reason = (f"stage {stage} is the cheapest stage that fits {count(w.params)} parameters ({shape}) in "
              f"{budget:.3g} GB per worker ({cluster.memory_bytes / 1e9:.3g} GB less a {margin:.0%} margin) on "
              f"{gpus} worker(s) [{others}]")
    return stage, table, reason


def _workers_needed(w: Workload, cluster: Cluster, gpus: int, dtype: str, micro_batch: int, checkpointing: bool,
                    margin: float, optimizer: str, run: Dict[str, Any]) -> Optional[int]:
    n = gpus
    while n < 1 << 16:
        n *= 2
        r = simulate(w, cluster, RunConfig(3, n, micro_batch, 1, dtype, checkpointing=checkpointing, optimizer=optimizer,
                                           **run))
        if _fits(r, cluster, margin):
            return n
    return None
