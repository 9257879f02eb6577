"""This machine's measurements behind benchmarks/plan_check.py's CPU rows (``plan_check.py --measure``).

These kinds, each written into one JSON (benchmarks/results/plan_cpu_measured.json by default):

- ``floor`` (in each ``steps`` row): per model of compare.py (``gpt``, ``mha``, ``hf-gpt2``, its
  default small sizes), one single-process step of one worker's batch in this process with one
  thread: forward+backward, and the fused AdamW step over one flat fp32 tensor of the model's size
  (the engine's flat optimizer), taken between the trainers' steps (``Floor``);
- ``contended`` (per model): the same floor step taken in as many processes as the machine has
  cores at once, started together at every step, each step followed by each copy's step alone
  while the others wait (``contended_floor``). Workers that fill every core compute slower than
  one process alone (they share the caches and the memory bandwidth), and a step's ranks wait for
  the slowest of them at its collectives: on this machine DDP's two ranks step at 1.17-1.24x the
  lone floor. plan_check calibrates the replay's compute from the lone floor of each row times
  the together/alone ratio of the same moments, and ``Cluster.straggler`` from the slowest copy
  of each step over the median copy;
- ``oversubscribed`` (per world size with more workers than cores, per model): the same with one
  copy per *worker*: ``W`` one-thread workers time-sharing ``C < W`` cores lose more than the
  ideal share ``W / C`` (the scheduler moves and interleaves them, their caches refill after every
  switch) and their slowest falls further behind; plan_check takes what exceeds the share;
- ``engine_solo`` (per model and for the tiny model): the engine's own single-process step of each
  stage (over a SoloGroup) beside the floor's step, with their CPU seconds: what the engine's hooks,
  gradient copies, fetching and bookkeeping add to the plain step on the worker's own thread;
- ``overlap`` (per world size): the plain step, the engine's point-to-point reduce-scatter and both
  at once on every rank of a gloo group (``measure_overlap``): whether gloo's transfers run beside
  the compute when the workers keep every core busy (the replay's ``Cluster.saturated``);
- ``gloo``: collectives.py's timings of the engine's own calls (the point-to-point exchange's
  all-gather and reduce-scatter, the stage-0 all-reduce) at each world size, over sizes that span
  the buckets and units of these models; plan_check fits α–β to them;
- ``steps``: real ``zr.Trainer`` steps, stages 0-3 at each world size and model, the four stages'
  trainers built at once and stepped in turn with the floor (compare.py's ``open_runs``) so that drift on
  a shared machine slows them alike; ``rounds`` times, each round with fresh trainers. Each row
  keeps its per-round medians, so the JSON says how noisy the machine was. ``overhead`` rows
  train a tiny model (d_model 32, one layer, 16 tokens) the same way: what a step costs with
  almost no work, the Ray call and the engine's fixed per-step work.

Nothing here predicts; plan_check.py compares. The measuring never runs two rows at once. The
workers run at the floor's niceness (0, not Ray's default 15), so that load from other processes
slows both alike.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from common import ROOT, BenchSpec, add_import_paths, build_model, global_batches  # noqa: E402

MODELS = ("gpt", "mha", "hf-gpt2")
GLOO_MB = (0.05, 0.5, 2.0, 8.0, 16.0)
OUT = os.path.join(ROOT, "benchmarks", "results", "plan_cpu_measured.json")


def spec_for(model: str, workers: int, steps: int, warmup: int) -> BenchSpec:
    """compare.py's default small sizes (d_model 256, 4 layers, 4 heads, 8 x 128 tokens per worker)."""
    return BenchSpec(model=model, num_workers=workers, timed_steps=steps, warmup_steps=warmup, threads=1)


class Floor:
    """One worker's batch on one thread, in this process (the driver): forward+backward of the model,
    and the fused AdamW step over one flat fp32 tensor of its size, as the engine's flat optimizer
    runs it. ``step`` times one of each; it is called between the trainers' steps, so that the
    calibration sees the same background load as the rows it calibrates."""

    def __init__(self, spec: BenchSpec) -> None:
        import torch

        torch.set_num_threads(1)
        self.spec = spec
        self.net = build_model(replace(spec, num_workers=1))
        self.numel = sum(p.numel() for p in self.net.parameters())
        self.flat = torch.nn.Parameter(torch.zeros(self.numel))
        self.flat.grad = torch.randn(self.numel)
        self.opt = torch.optim.AdamW([self.flat], lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
        self.fwd_bwd: List[float] = []
        self.adamw: List[float] = []
        self.cpu_fwd_bwd: List[float] = []  # the process's CPU seconds of each (one thread: its own)
        self.cpu_adamw: List[float] = []

    def step(self, batch) -> None:
        import bench_models

        share = tuple(t[:self.spec.batch_per_worker] for t in batch)
        for p in self.net.parameters():
            p.grad = None
        c0, t0 = time.process_time(), time.perf_counter()
        bench_models.lm_loss(self.net, share).backward()
        c1, t1 = time.process_time(), time.perf_counter()
        self.opt.step()
        c2, t2 = time.process_time(), time.perf_counter()
        self.fwd_bwd.append(t1 - t0)
        self.adamw.append(t2 - t1)
        self.cpu_fwd_bwd.append(c1 - c0)
        self.cpu_adamw.append(c2 - c1)


def _contended_rank(spec: BenchSpec, rank: int, copies: int, barrier, out) -> None:
    add_import_paths()
    floor = Floor(spec)
    alone: Dict[str, List[float]] = {"fwd_bwd": [], "adamw": []}
    for batch in global_batches(spec):
        barrier.wait()  # every copy starts its step together, as a step's workers do
        floor.step(batch)
        for turn in range(copies):  # then each copy alone in turn, the others waiting: the same moment's load
            barrier.wait()
            if turn == rank:
                floor.step(batch)
                alone["fwd_bwd"].append(floor.fwd_bwd.pop())
                alone["adamw"].append(floor.adamw.pop())
                alone.setdefault("cpu_fwd_bwd", []).append(floor.cpu_fwd_bwd.pop())
    w = spec.warmup_steps
    out.put({"rank": rank, "fwd_bwd": floor.fwd_bwd[w:], "adamw": floor.adamw[w:],
             "alone_fwd_bwd": alone["fwd_bwd"][w:], "alone_adamw": alone["adamw"][w:],
             "cpu_fwd_bwd": floor.cpu_fwd_bwd[w:], "alone_cpu_fwd_bwd": alone.get("cpu_fwd_bwd", [])[w:]})


def contended_floor(spec: BenchSpec, copies: int) -> Dict[str, Any]:
    """``Floor``'s step in ``copies`` processes at once (one per core), started together at every
    step, each step followed by each copy's step alone while the others wait (the ratio of the two
    is then taken at the same moment's background load). Medians over every copy's timed steps,
    and ``slowest_fwd_bwd_s``: the median over steps of the slowest copy's time, the pace of ranks
    that meet at every step's collectives (plan.Cluster's ``straggler``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(copies), ctx.Queue()
    procs = [ctx.Process(target=_contended_rank, args=(spec, r, copies, barrier, out)) for r in range(copies)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    fwd_bwd = [x for r in results for x in r["fwd_bwd"]]
    adamw = [x for r in results for x in r["adamw"]]
    alone = [x for r in results for x in r["alone_fwd_bwd"]]
    slowest = [max(step) for step in zip(*(r["fwd_bwd"] for r in results))]
    return {"copies": copies, "fwd_bwd_s": statistics.median(fwd_bwd), "adamw_s": statistics.median(adamw),
            "slowest_fwd_bwd_s": statistics.median(slowest), "alone_fwd_bwd_s": statistics.median(alone),
            "fwd_bwd_all_s": fwd_bwd, "adamw_all_s": adamw, "slowest_fwd_bwd_all_s": slowest,
            "alone_fwd_bwd_all_s": alone, "alone_adamw_all_s": [x for r in results for x in r["alone_adamw"]],
            # CPU seconds of the same steps: together over alone is what sharing the caches and memory
            # costs; the wall times add the waits for a core
            "cpu_fwd_bwd_all_s": [x for r in results for x in r["cpu_fwd_bwd"]],
            "alone_cpu_fwd_bwd_all_s": [x for r in results for x in r["alone_cpu_fwd_bwd"]],
            "load": os.getloadavg(), "at": time.time()}


def measure_contention(models=MODELS, steps: int = 8, warmup: int = 3) -> Dict[str, Any]:
    """``contended_floor`` for each model at compare.py's default sizes, one copy per core."""
    add_import_paths()
    out = {}
    for m in models:
        out[m] = contended_floor(spec_for(m, 1, steps, warmup), os.cpu_count() or 1)
        c = out[m]
        print(f"  {m}: floor forward+backward with every core busy {c['fwd_bwd_s'] * 1e3:.0f} ms (the slowest copy "
              f"{c['slowest_fwd_bwd_s'] * 1e3:.0f} ms; alone {c['alone_fwd_bwd_s'] * 1e3:.0f} ms), "
              f"AdamW {c['adamw_s'] * 1e3:.1f} ms ({c['copies']} copies)", flush=True)
    return out


def measure_oversubscribed(models=MODELS, worlds=(3,), steps: int = 8, warmup: int = 3) -> Dict[str, Any]:
    """``contended_floor`` with one copy per *worker*, for each world size with more workers than
    the machine has cores: ``{str(W): {model: ...}}``. ``contended`` (one copy per core) says how
    workers that each have a core slow each other; it cannot say how ``W`` one-thread workers
    time-sharing ``C < W`` cores progress, nor how far the slowest of them falls behind at the step's
    meetings. plan_check divides the ideal share ``W / C`` out of the together/alone ratio (the
    replay's ``core_share`` holds it) and takes the rest, and the slowest copy, from here."""
    add_import_paths()
    cores = os.cpu_count() or 1
    out: Dict[str, Any] = {}
    for world in worlds:
        if world <= cores:
            continue
        out[str(world)] = {}
        for m in models:
            c = out[str(world)][m] = contended_floor(spec_for(m, 1, steps, warmup), world)
            print(f"  {m}, {world} copies on {cores} cores: forward+backward {c['fwd_bwd_s'] * 1e3:.0f} ms (the slowest "
                  f"copy {c['slowest_fwd_bwd_s'] * 1e3:.0f} ms; alone {c['alone_fwd_bwd_s'] * 1e3:.0f} ms)", flush=True)
    return out


def _engine_solo_model(spec: BenchSpec, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    import bench_models

    import zeroray as zr
    from common import model_fn
    from zeroray.comm.group import SoloGroup
    from zeroray.engine.engine import Engine

    floor = Floor(spec)  # sets one thread
    engines = {s: Engine(model_fn(replace(spec, num_workers=1)), bench_models.lm_loss,
                         zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay), zr.ZeroConfig(stage=s), SoloGroup(),
                         seed=spec.seed) for s in stages}
    wall: Dict[int, List[float]] = {s: [] for s in stages}
    cpu: Dict[int, List[float]] = {s: [] for s in stages}
    try:
        for batch in global_batches(spec):
            share = tuple(t[:spec.batch_per_worker] for t in batch)
            for s, engine in engines.items():
                c0, t0 = time.process_time(), time.perf_counter()
                engine.train_step(share)
                wall[s].append(time.perf_counter() - t0)
                cpu[s].append(time.process_time() - c0)
            floor.step(batch)  # right after: the same moment's background load
    finally:
        for engine in engines.values():
            engine.close()
    w = spec.warmup_steps
    # The CPU seconds too: what the engine adds is work on the worker's thread, which the process's
    # CPU time counts whatever else shares the machine (wall times also count the waits for a core).
    return {"params": floor.numel, "fwd_bwd_all_s": floor.fwd_bwd[w:], "adamw_all_s": floor.adamw[w:],
            "cpu_fwd_bwd_all_s": floor.cpu_fwd_bwd[w:], "cpu_adamw_all_s": floor.cpu_adamw[w:],
            "stages": {str(s): {"engine_step_all_s": wall[s][w:], "cpu_engine_step_all_s": cpu[s][w:]} for s in stages},
            "load": os.getloadavg(), "at": time.time()}


def engine_solo(models=MODELS, steps: int = 20, warmup: int = 3) -> Dict[str, Any]:
    """The engine's own single-process step of each stage (over a ``SoloGroup``: the hooks, the
    gradient copies into the buckets, stage 3's fetching, the flat AdamW and the step's bookkeeping,
    no peer), the four stages' engines and the floor stepped in turn in this process on one thread,
    per model and for the overhead rows' tiny model (``tiny``). What the engine's step costs on one
    process beyond the plain PyTorch step is the engine's, not the cluster's: plan_check calibrates
    each stage's compute from it (each row's lone floor times the engine/floor ratio of the same
    moments)."""
    add_import_paths()
    out: Dict[str, Any] = {}
    for m in models + ("tiny",):
        spec = tiny_spec(1, steps, warmup) if m == "tiny" else spec_for(m, 1, steps, warmup)
        r = out[m] = _engine_solo_model(spec)
        print(f"  {m}: the engine's single-process step " + ", ".join(
            f"stage {s} {statistics.median(x['cpu_engine_step_all_s']) * 1e3:.1f}" for s, x in r["stages"].items()) +
            f" ms of CPU; the floor's forward+backward {statistics.median(r['cpu_fwd_bwd_all_s']) * 1e3:.1f} ms + "
            f"AdamW {statistics.median(r['cpu_adamw_all_s']) * 1e3:.1f} ms", flush=True)
    return out


def _overlap_rank(spec: BenchSpec, rank: int, world: int, port: int, mb: float, steps: int, warmup: int,
                  out) -> None:
    torch_threads = 1
    import torch

    torch.set_num_threads(torch_threads)
    add_import_paths()
    from zeroray.comm.group import TorchGroup, make_torch_group

    native = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    p2p = TorchGroup(native.pg, rank, world, "gloo", point_to_point=True)
    native.exchange = None
    n = int(mb * 1e6) // 4 // world * world
    full, shard = torch.randn(n), torch.empty(n // world)
    scratch = torch.empty(p2p.scratch_numel(n // world))
    floor = Floor(spec)
    batch = next(iter(global_batches(spec)))
    tick = torch.zeros(1)
    times: Dict[str, List[float]] = {"compute": [], "comm": [], "both": [], "cpu_compute": []}

    def compute() -> None:
        floor.step(batch)
        floor.fwd_bwd.pop(), floor.adamw.pop(), floor.cpu_fwd_bwd.pop(), floor.cpu_adamw.pop()

    for i in range(warmup + steps):
        for name in ("compute", "comm", "both"):
            native.all_reduce(tick)  # the ranks start each part together
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "compute":
                compute()
            else:
                handle = p2p.reduce_scatter(shard, full, async_op=True, scratch=scratch)
                if name == "both":
                    compute()
                handle.wait()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                if name == "compute":  # one thread: its CPU seconds, to tell a step other processes slowed
                    times["cpu_compute"].append(time.process_time() - c0)
    native.close()
    if rank == 0:
        out.put(times)


def measure_overlap(worlds=(2, 3), model: str = "gpt", mb: float = 64.0, steps: int = 10,
                    warmup: int = 2, rows: int = 1) -> Dict[str, Any]:
    """Whether gloo's transfers run beside the compute when the workers keep every core busy (the
    replay's ``Cluster.saturated`` rule): per world size, ``world`` processes each time their plain step
    (forward+backward and the flat AdamW, one thread), the engine's point-to-point reduce-scatter of
    ``mb`` MB alone, and both at once (the reduce-scatter launched, then the step, then its wait), the
    three started together on every rank and interleaved step by step. ``overlap``: the share of the
    shorter part hidden, ``(compute + comm - both) / min(compute, comm)`` over rank 0's medians (1: the
    transfer ran entirely beside the compute; 0: not at all). The step is of ``rows`` sequences, so that
    it lasts about as long as the transfer and neither hides in the other's noise; ``cpu_compute_s``,
    its CPU seconds, tells a run other processes slowed (plan_check refuses it, calibrate.undisturbed)."""
    import torch.multiprocessing as mp

    from zeroray.comm.port import free_port

    add_import_paths()
    ctx = mp.get_context("spawn")
    out: Dict[str, Any] = {}
    for world in worlds:
        queue, port = ctx.Queue(), free_port()
        spec = replace(spec_for(model, 1, steps, warmup), batch_per_worker=rows)
        procs = [ctx.Process(target=_overlap_rank, args=(spec, r, world, port, mb, steps, warmup, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        times = queue.get(timeout=900)
        for proc in procs:
            proc.join()
        med = {k: statistics.median(v) for k, v in times.items()}
        overlap = (med["compute"] + med["comm"] - med["both"]) / min(med["compute"], med["comm"])
        out[str(world)] = {**{f"{k}_all_s": v for k, v in times.items()}, **{f"{k}_s": v for k, v in med.items()},
                           "overlap": overlap, "mb": mb, "model": model, "load": os.getloadavg(), "at": time.time()}
        print(f"  {world} ranks on {os.cpu_count()} cores: step {med['compute'] * 1e3:.0f} ms, reduce-scatter of {mb:g} MB "
              f"{med['comm'] * 1e3:.0f} ms, both at once {med['both'] * 1e3:.0f} ms: overlap {overlap:.2f}", flush=True)
    return out


def tiny_spec(workers: int, steps: int, warmup: int) -> BenchSpec:
    """The overhead rows' model: almost no work, the Ray call and the engine's fixed per-step work."""
    return replace(spec_for("gpt", workers, steps, warmup), d_model=32, n_layers=1, n_heads=1, seq_len=16,
                   batch_per_worker=1)


def calibrate_gloo(worlds: List[int], sizes_mb=GLOO_MB) -> List[Dict[str, Any]]:
    """collectives.py's rows (ms, median of rank 0's timed calls) at each world size."""
    import torch.multiprocessing as mp

    import collectives
    from zeroray.comm.port import free_port

    ctx = mp.get_context("spawn")
    rows = []
    for world in worlds:
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=collectives._rank, args=(r, world, port, list(sizes_mb), queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        rows += [queue.get(timeout=600) for _ in sizes_mb]
        for proc in procs:
            proc.join()
    return rows


def measure_steps(session, model: str, workers: int, steps: int, warmup: int, rounds: int,
                  spec: BenchSpec = None) -> Dict[str, Any]:
    """Stages 0-3 of one model at one world size, stepped in turn with the single-process floor
    (one step of each, then the next), ``rounds`` times with fresh trainers."""
    spec = spec or spec_for(model, workers, steps, warmup)
    rows = {f"zr{s}": (s, None) for s in range(4)}
    per_round: Dict[str, List[float]] = {name: [] for name in rows}
    all_steps: Dict[str, List[float]] = {name: [] for name in rows}
    comm: Dict[str, Any] = {}
    floor = Floor(spec)
    floor_rounds: List[Dict[str, float]] = []
    for _ in range(rounds):
        runs = session.open_runs(rows, spec, prefetch=True)
        mark = len(floor.fwd_bwd)
        try:
            for i, batch in enumerate(global_batches(spec)):
                for run in runs.values():
                    run.step(batch)
                floor.step(batch)
            records = {name: run.record() for name, run in runs.items()}
        finally:
            for run in runs.values():
                run.close()
        for name, rec in records.items():
            timed = rec["step_s"][spec.warmup_steps:]
            per_round[name].append(statistics.median(timed))
            all_steps[name] += timed
            comm[name] = rec.get("comm")
        floor_rounds.append({k: statistics.median(getattr(floor, k)[mark + spec.warmup_steps:])
                             for k in ("fwd_bwd", "adamw")})
    timed = [i for r in range(rounds) for i in range(r * spec.total_steps + spec.warmup_steps, (r + 1) * spec.total_steps)]
    out: Dict[str, Any] = {name: {"stage": rows[name][0], "median_s": statistics.median(all_steps[name]),
                                  "round_medians_s": per_round[name], "steps_s": all_steps[name], "comm": comm[name]}
                           for name in rows}
    out["floor"] = {"params": floor.numel, "tokens": spec.batch_per_worker * spec.seq_len,
                    "fwd_bwd_s": statistics.median(floor.fwd_bwd[i] for i in timed),
                    "adamw_s": statistics.median(floor.adamw[i] for i in timed),
                    "fwd_bwd_all_s": [floor.fwd_bwd[i] for i in timed], "adamw_all_s": [floor.adamw[i] for i in timed],
                    "round_medians": floor_rounds, "spec": spec.as_dict()}
    return out


def measure(models=MODELS, worlds=(2, 3), rounds: int = 2, steps: int = 8, warmup: int = 3,
            out: str = OUT) -> Dict[str, Any]:
    add_import_paths()
    t0 = time.time()
    result: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                          "load_before": os.getloadavg()},
                              "settings": {"rounds": rounds, "steps": steps, "warmup": warmup,
                                           "spec": spec_for(models[0], worlds[0], steps, warmup).as_dict()}}
    print("gloo: collectives.py at world sizes", list(worlds), "...", flush=True)
    result["gloo"] = calibrate_gloo(list(worlds))
    print("the floor with every core busy ...", flush=True)
    result["contended"] = measure_contention(models, steps, warmup)
    print("the floor with more workers than cores ...", flush=True)
    result["oversubscribed"] = measure_oversubscribed(models, worlds, steps, warmup)
    print("gloo beside the compute ...", flush=True)
    result["overlap"] = measure_overlap(worlds, steps=steps, warmup=warmup)
    print("the engine's single-process step ...", flush=True)
    result["engine_solo"] = engine_solo(models, warmup=warmup)
    from zr_run import ZeroraySession

    import logging

    import ray

    session = ZeroraySession()  # first: it sets the PYTHONPATH the workers need
    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if started:  # room for the four stages' workers at once (zeroray's own local Ray has max(cores, 8) CPUs)
        ray.init(num_cpus=max(16, 4 * max(worlds)), include_dashboard=False, logging_level=logging.WARNING)
    result["steps"], result["overhead"] = {}, {}

    def write() -> None:  # after every row set, so that an interrupted run keeps what it measured
        result["machine"]["load_after"] = os.getloadavg()
        result["wall_s"] = time.time() - t0
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    try:
        for workers in worlds:
            tiny = tiny_spec(workers, steps, warmup)
            rec = measure_steps(session, "gpt", workers, steps, warmup, rounds, spec=tiny)
            result["overhead"][str(workers)] = rec
            print(f"  overhead, {workers} workers (tiny model): " +
                  ", ".join(f"{n} {r['median_s'] * 1e3:.1f} ms" for n, r in rec.items() if n != "floor"), flush=True)
            for m in models:
                rec = measure_steps(session, m, workers, steps, warmup, rounds)
                result["steps"][f"{m}/{workers}"] = rec
                print(f"  {m}, {workers} workers: " + ", ".join(
                    f"{n} {r['median_s'] * 1e3:.0f} ms (rounds {'/'.join(f'{x * 1e3:.0f}' for x in r['round_medians_s'])})"
                    for n, r in rec.items() if n != "floor") +
                    f"; floor fwd+bwd {rec['floor']['fwd_bwd_s'] * 1e3:.0f} ms, AdamW {rec['floor']['adamw_s'] * 1e3:.1f} ms",
                    flush=True)
                write()
    finally:
        session.close()
        if started and ray.is_initialized():
            ray.shutdown()
    write()
    print(f"wrote {out} ({result['wall_s']:.0f} s)", flush=True)
    return result
