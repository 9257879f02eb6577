"""What the soak samples, and how its slopes are fitted: shared by benchmarks/soak.py (3,000 steps
of the main job's GPT) and tests/ray/test_soak.py (its short version).

[Note: sampling inside fit]
The soak samples every ``every`` steps of one long ``fit``, through the public API only. fit has
no callback, so the sampler sits in the data: ``SoakData`` wraps the global batches, and the
driver takes a sample as fit asks for the batch of step ``k * every + 1``. With
``CheckpointConfig(every_steps=every)`` that is a quiet moment: fit sends no step behind one
that saves until that step is collected and saved ([Note: pipelined steps] in the fit loop), so
when it asks for the next batch no step is in flight, step ``k * every`` is applied on every
worker, its checkpoint written and its snapshot stored. The data is re-iterable (fit replays it
from the start after a failure, skipping the batches already trained), so a sample or the kill
happens only the first time its batch is reached.

Not chosen: ``fit(data, num_steps=every)`` in chunks. Each fit releases its snapshot when it
ends (the snapshot serves one fit), so a sample between chunks sees an object store without
one, and each chunk's first step has no snapshot yet: a worker lost there recovers from the
disk checkpoint, not from memory. Each fit also counts ``max_failures`` afresh. Chunks would
measure another run than one long fit.

What is read, and from where (all on the driver's machine: the local Ray of a benchmark or test):
- each process's ``/proc/<pid>/status``: VmRSS, and of it RssAnon (the process's own heap) and
  RssShmem (shared memory it mapped and touched: for a worker, the pages of Ray's object store
  it wrote its snapshot shards into, which are the store's, not the worker's);
- ``/proc/<pid>/fd``: its open file descriptors;
- the processes: the driver, every worker of ``trainer.workers`` (pids, re-read at each sample
  so a replacement is followed), and Ray's raylet and GCS server where this driver started them;
- the object store: the raylets' own account (``FormatGlobalMemoryInfo``, what ``ray memory
  --stats-only`` prints), over all nodes: the bytes plasma holds, the objects, and of the bytes
  the primary copies, which are the objects still referenced (the live ones); the rest are
  objects already released that the raylet deletes in batches (here 0.5-1 s after their
  release), so the bytes held move with when a sample falls, the live bytes do not. Also the
  capacity less ``ray.available_resources()["object_store_memory"]``, which follows the bytes
  held as of the raylet's last resource report, as a cross-check.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import ray

MiB = 2**20


def proc_figures(pid: int) -> Optional[Dict[str, int]]:
    """``rss``, ``anon``, ``shmem`` (bytes) and ``fds`` of a live process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields.get("State", "").strip().startswith("Z"):
        return None  # a zombie holds no memory
    kib = {name: int(fields[key].split()[0]) * 1024 for name, key in
           (("rss", "VmRSS"), ("anon", "RssAnon"), ("shmem", "RssShmem"))}
    return {**kib, "fds": fds}


def store_figures() -> Dict[str, int]:
    """The object store's use over all nodes, as the raylets count it (``ray memory --stats-only``)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    # this driver's cluster: other Ray instances may run on the machine
    address = ray.get_runtime_context().gcs_address
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    capacity = ray.cluster_resources().get("object_store_memory", 0)
    return {"bytes_used": int(stats.object_store_bytes_used), "objects": int(stats.num_local_objects),
            "primary_bytes": int(stats.object_store_bytes_primary_copy),
            "fallback_bytes": int(stats.object_store_bytes_fallback),
            "spilled_bytes": int(stats.spilled_bytes_total),
            "resource_used_bytes": int(capacity - ray.available_resources().get("object_store_memory", capacity))}


def ray_process_pids() -> Dict[str, int]:
    """The raylet's and GCS server's pids when this driver started the local Ray ({} otherwise)."""
    node = getattr(ray._private.worker, "_global_node", None)
    found: Dict[str, int] = {}
    if node is None:
        return found
    try:
        for kind, process in node.live_processes():
            if kind in ("raylet", "gcs_server"):
                found[kind] = process.pid
    except Exception:  # noqa: BLE001 - a driver attached to a cluster it did not start
        return {}
    return found


class Sampler:
    """Samples of the driver, the workers, Ray's own processes and the object store, one per step."""

    def __init__(self, trainer: Any, on_sample: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        self.trainer = trainer
        self.samples: List[Dict[str, Any]] = []
        self.on_sample = on_sample
        self.ray_pids = ray_process_pids()

    def take(self, step: int, when: str = "in fit") -> Dict[str, Any]:
        workers = []
        for w in self.trainer.workers:  # re-read: a recovery replaces a worker by another process
            figures = proc_figures(w["pid"])
            workers.append({"rank": w["rank"], "pid": w["pid"], **(figures or {"gone": True})})
        sample = {"step": step, "when": when, "time": time.time(), "loadavg": _loadavg(),
                  "driver": proc_figures(os.getpid()), "workers": workers, "store": store_figures(),
                  "ray": {kind: proc_figures(pid) for kind, pid in self.ray_pids.items()}}
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample


def _loadavg() -> List[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class SoakData:
    """fit's data: ``batches`` (re-iterable), with a sample taken as the batch of step ``k * every
    + 1`` is asked for (after step ``k * every``, ``k`` from 0), and for each ``(step, rank)`` of
    ``kills`` worker ``rank`` SIGKILLed by its pid as the batch of ``step`` is asked for; each
    only the first time that batch is reached ([Note: sampling inside fit]). ``killed``: one
    record per kill done (step, rank, pid, the steps applied then, time)."""

    def __init__(self, batches: Iterable[Any], sampler: Sampler, every: int,
                 kills: Sequence[Tuple[int, int]] = ()) -> None:
        self.batches, self.sampler, self.every = batches, sampler, every
        self.kills = dict(kills)
        self.sampled: set = set()
        self.killed: List[Dict[str, Any]] = []

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            step = index + 1  # the step this batch trains (fit's data starts at step 1)
            if index % self.every == 0 and index not in self.sampled:
                self.sampled.add(index)
                self.sampler.take(index)
            if step in self.kills and all(k["step"] != step for k in self.killed):
                self.killed.append(self._kill(step, self.kills[step]))
            yield batch

    def _kill(self, step: int, rank: int) -> Dict[str, Any]:
        trainer = self.sampler.trainer
        pid = next(w["pid"] for w in trainer.workers if w["rank"] == rank)
        killed = {"step": step, "rank": rank, "pid": pid, "applied": trainer.step_count, "time": time.time()}
        os.kill(pid, signal.SIGKILL)
        return killed


# --- the series and their slopes ---------------------------------------------------------------


def series(samples: Sequence[Dict[str, Any]]) -> Dict[str, List[Optional[float]]]:
    """Per figure, its value at each sample (None where it was not measured): ``driver_rss``,
    ``driver_anon``, ``driver_fds``, ``w<r>_rss`` / ``_anon`` / ``_fds`` / ``_pid`` per rank,
    ``store_bytes``, ``store_objects``, ``raylet_anon``, ``gcs_server_anon``."""
    out: Dict[str, List[Optional[float]]] = {}

    def put(name: str, i: int, value: Optional[float]) -> None:
        out.setdefault(name, [None] * len(samples))[i] = value

    for i, s in enumerate(samples):
        for key in ("rss", "anon", "fds"):
            put(f"driver_{key}", i, (s["driver"] or {}).get(key))
        for w in s["workers"]:
            for key in ("rss", "anon", "fds", "pid"):
                put(f"w{w['rank']}_{key}", i, w.get(key))
        put("store_bytes", i, s["store"]["bytes_used"])
        put("store_primary", i, s["store"]["primary_bytes"])
        put("store_objects", i, s["store"]["objects"])
        for kind, figures in s["ray"].items():
            put(f"{kind}_anon", i, (figures or {}).get("anon"))
    return out


def fit_slope(steps: Sequence[float], values: Sequence[float], jumps: Sequence[int] = ()) -> Dict[str, Any]:
    """Least squares ``value = a + b * step / 1000 + sum_k c_k * [step >= jumps[k]]``: ``slope`` is b,
    the change per 1,000 steps, and ``jumps`` the c_k, one-off level shifts from the samples at
    ``jumps`` on (the first sample after each kill), fitted apart so that none is read as a slope.
    A shift with no sample on one side of it is left out (its c is None)."""
    x = np.asarray(steps, dtype=float)
    y = np.asarray(values, dtype=float)
    columns = [np.ones_like(x), x / 1000.0]
    fitted_jumps: List[Optional[int]] = []
    for at in jumps:
        shift = (x >= at).astype(float)
        fits = 0 < shift.sum() < len(x) and not any(np.array_equal(shift, c) for c in columns[2:])
        fitted_jumps.append(len(columns) if fits else None)
        if fits:
            columns.append(shift)
    coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), y, rcond=None)
    return {"slope": float(coef[1]), "n": len(x),
            "jumps": [None if j is None else float(coef[j]) for j in fitted_jumps]}


def slopes(samples: Sequence[Dict[str, Any]], warmup_steps: int,
           killed: Sequence[Dict[str, Any]] = ()) -> Dict[str, Dict[str, Any]]:
    """Each figure's slope per 1,000 steps over the samples taken inside fit from ``warmup_steps``
    on, each kill's jump fitted apart (from the first sample after it). A killed rank's new
    process warms up again: that rank's samples from the kill to ``warmup_steps`` after it are
    left out of its series."""
    inside = [s for s in samples if s["when"] == "in fit"]
    values = series(inside)
    firsts = [min((s["step"] for s in inside if s["step"] >= k["step"]), default=None) for k in killed]
    jumps = [f for f in firsts if f is not None]
    out: Dict[str, Dict[str, Any]] = {}
    for name, column in values.items():
        if name.endswith("_pid"):
            continue
        warming = [(f, f + warmup_steps) for k, f in zip(killed, firsts)
                   if f is not None and name.startswith(f"w{k['rank']}_")]
        used = [(s["step"], v) for s, v in zip(inside, column) if v is not None and s["step"] >= warmup_steps
                and not any(lo <= s["step"] < hi for lo, hi in warming)]
        if len(used) < 3:
            continue
        fitted = fit_slope([u[0] for u in used], [u[1] for u in used], jumps)
        out[name] = {**fitted, "steps": [u[0] for u in used]}
    return out


# --- the printed table ------------------------------------------------------------------------


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def _count(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def columns(samples: Sequence[Dict[str, Any]]) -> List[tuple]:
    """(name, heading, format) per column of the table: the driver, each rank, the store, Ray's processes."""
    ranks = sorted({w["rank"] for s in samples for w in s["workers"]})
    ray_kinds = sorted({kind for s in samples for kind in s["ray"]})
    cols = [("driver_rss", "drv RSS", _mib), ("driver_anon", "drv heap", _mib)]
    for r in ranks:
        cols += [(f"w{r}_rss", f"w{r} RSS", _mib), (f"w{r}_anon", f"w{r} heap", _mib)]
    cols += [("store_bytes", "store", _mib), ("store_primary", "store live", _mib),
             ("store_objects", "objects", _count), ("driver_fds", "drv fds", _count)]
    cols += [(f"w{r}_fds", f"w{r} fds", _count) for r in ranks]
    cols += [(f"{kind}_anon", f"{kind.split('_')[0]} heap", _mib) for kind in ray_kinds]
    return cols


def format_table(samples: Sequence[Dict[str, Any]], killed: Sequence[Dict[str, Any]] = ()) -> str:
    """One line per sample (MiB; heap is RssAnon); ``*`` marks the first sample after a kill."""
    values = series(samples)
    cols = columns(samples)
    head = ["step", "load"] + [c[1] for c in cols]
    rows = []
    firsts = {min((s["step"] for s in samples if s["step"] >= k["step"]), default=None) for k in killed}
    for i, s in enumerate(samples):
        mark = "*" if s["step"] in firsts and s["when"] == "in fit" else ""
        when = "" if s["when"] == "in fit" else f" ({s['when']})"
        rows.append([f"{s['step']}{mark}{when}", f"{s['loadavg'][0]:.1f}"]
                    + [fmt(values.get(name, [None] * len(samples))[i]) for name, _, fmt in cols])
    widths = [max(len(r[j]) for r in rows + [head]) for j in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_slopes(fitted: Dict[str, Dict[str, Any]], samples: Sequence[Dict[str, Any]]) -> str:
    """Each figure's slope per 1,000 steps and jump at each kill (MiB for bytes, counts otherwise)."""
    lines = [f"{'figure':>16}  {'per 1,000 steps':>15}  {'jump at kill':>12}  samples (steps)"]
    for name, heading, fmt in columns(samples):
        if name not in fitted:
            continue
        f = fitted[name]
        scale = MiB if fmt is _mib else 1
        unit = " MiB" if fmt is _mib else ""
        jump = ", ".join("-" if j is None else f"{j / scale:+.2f}{unit}" for j in f["jumps"]) or "-"
        steps = f["steps"]
        lines.append(f"{heading:>16}  {f['slope'] / scale:+12.2f}{unit:4}  {jump:>12}  "
                     f"{len(steps)} ({steps[0]}-{steps[-1]})")
    return "\n".join(lines)
