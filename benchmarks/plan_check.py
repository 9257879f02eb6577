"""Predicted vs published or measured: every check of zeroray.plan's step simulator, and apart from
them the calibration it was given.

    PYTHONPATH=. python benchmarks/plan_check.py

Every row prints what the simulator (``plan.simulate`` or the planner built on it) predicts. Rows are
of two kinds, printed apart:

- **checks**, counted: a prediction against a published or measured figure that nothing in the
  simulator's inputs was taken from;
- **calibration**, never counted: the figures the simulator's inputs were taken from, and rows that
  cannot tell a good simulator from a bad one (their prediction is the calibration point itself).

The checks:
- the ZeRO paper and torchtitan's published figures (tests/plan_published.py, which also says
  their sources; tests/unit/test_plan_published.py asserts them in the suite);
- the H200 evidence (808M bf16, world 1, measured before the GPU fixes of the stop that followed it
  and not re-measured since): the NCCL steps of stages 1 and 3 and stage 3's peak; the plain step is
  the calibration point, and the SoloGroup steps are predicted as that point;
- this machine, held out ([Note: held-out split] below): stages 0-3 at 2 and 3 workers of the models
  the CPU calibration never saw, read from benchmarks/results/plan_cpu_measured.json (``--measure``
  takes it; ``--measure-only PARTS`` adds calibration parts to a kept one; ``--from PATH`` reads
  another; ``--without PARTS`` recomputes without parts of the calibration);
- fits.py's offload rows: the largest model that fits under a per-worker peak RSS with
  ``offload="disk"``, from the footprint calibrated on the same runs' in-memory rows.

[Note: held-out split]
The CPU calibration comes from one set of models and the checks from another: ``CALIBRATION_MODELS``
(gpt, and the tiny model of the fixed per-step cost) give every figure the simulator is told about
this machine: the engine's single-process ratio per stage, the together/alone ratio and the slowest
copy at each worker count, the fixed per-step cost per stage and worker count, the optimizer's
bandwidth, and gloo's α–β (collectives.py, no model). The held-out models (``HELD_OUT``: mha,
hf-gpt2) enter only as their module (units, FLOPs) and their single-process plain step (one process,
one thread, no engine, no peer: the floor taken between the rows' steps), the one thing about a
model a user can time before training it. Their rows are checks; gpt's rows, whose model gave the
calibration, are printed under it and not counted. A second reading ("FLOPs only") leaves out even
the held-out model's floor: its compute is its FLOPs at gpt's achieved rate.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)  # tests/plan_published.py

from zeroray import plan  # noqa: E402
from zeroray.plan.calibrate import (contended_figures, cpu_cluster, engine_ratio, gloo_ring, quantile,  # noqa: E402
                                    undisturbed)

CALIBRATION_MODELS = ("gpt",)  # and "tiny", the overhead rows' model
HELD_OUT = ("mha", "hf-gpt2")
CHECKS, CALIBRATION = [], []


def row(name: str, predicted: float, reference: float, bound: float, unit: str = "", side: str = "",
        calibration: bool = False, note: str = "") -> None:
    """A check (counted) or, with ``calibration``, a calibration row (printed apart, never counted).
    ``side`` ">=": the reference is a floor the prediction may exceed."""
    err = predicted / reference - 1
    ok = abs(err) <= bound or (side == ">=" and predicted >= reference)
    (CALIBRATION if calibration else CHECKS).append(
        (name, f"{predicted:,.4g}{unit}", f"{reference:,.4g}{unit}", f"{err:+.1%}",
         f"±{bound:.0%}" + (f" or {side}" if side else ""), "-" if calibration else ("ok" if ok else "OUT"), note))


def published() -> None:
    from tests import plan_published

    for r in plan_published.rows():
        row(r.name, r.predicted, r.reference, r.bound, r.unit, r.side, note=r.note)


def h200() -> None:
    import gpt

    cfg = gpt.GPTConfig(d_model=2048, n_layers=16, n_heads=16, seq_len=1024)
    w = plan.from_module(lambda: gpt.GPT(cfg), seq_len=1024, hidden=2048, heads=16)
    base = plan.cluster_preset("h200", gpus_per_node=1)
    run = plan.RunConfig(0, 1, micro_batch=8, dtype="bf16", checkpointing=False, optimizer="adamw")
    # calibrate: the plain PyTorch step (0.0934 s) fixes ``achieved``
    probe = plan.simulate(w, base, run)
    achieved = base.achieved * probe.compute_s / (0.0934 - probe.optimizer_s)
    cal = replace(base, achieved=achieved)
    solo = replace(cal, launch_s=0.0)
    print(f"H200 calibration: achieved {achieved:.3f} of peak from the plain step ({w.params / 1e6:.0f}M params); "
          "the evidence predates the GPU fixes of the next stop and was not re-measured (no GPU since)")
    row("H200 808M plain step s (the calibration point)", plan.simulate(w, solo, run).step_s, 0.0934, 0.15, " s",
        calibration=True)
    for stage, measured in ((1, 0.0938), (3, 0.0994)):
        r = plan.simulate(w, solo, replace(run, stage=stage))
        row(f"H200 808M SoloGroup stage {stage} step s (no collective, no launch: predicted as the calibration point)",
            r.step_s, measured, 0.15, " s", calibration=True)
    for stage, measured in ((1, 0.0977), (3, 0.1384)):
        r = plan.simulate(w, cal, replace(run, stage=stage))
        row(f"H200 808M NCCL world-1 stage {stage} step s ({r.collectives} collectives)", r.step_s, measured, 0.15, " s")
    r = plan.simulate(w, solo, replace(run, stage=3))
    # gpu_check's peak is torch.cuda.max_memory_allocated: what the allocator handed out, without
    # the CUDA context or fragmentation; the footprint's "allocated" is the same quantity
    row("H200 808M stage 3 allocated peak GiB (max_memory_allocated 22.04, gpu_check)",
        r.memory["allocated"] / 2**30, 22.04, 0.15, " GiB")


def bench_workload(spec: dict) -> plan.Workload:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import functools

    import bench_models

    fn = functools.partial(bench_models.build, spec["model"], spec["vocab_size"], spec["seq_len"], spec["d_model"],
                           spec["n_layers"], spec["n_heads"])
    return plan.from_module(fn, seq_len=spec["seq_len"], hidden=spec["d_model"], heads=spec["n_heads"])


def at_quantile(rec: dict, q: float) -> dict:
    """A measured row set with every figure taken at quantile ``q`` of its steps (the floor's too)."""
    out = {name: dict(r, median_s=quantile(r["steps_s"], q)) for name, r in rec.items() if name != "floor"}
    f = rec["floor"]
    out["floor"] = dict(f, fwd_bwd_s=quantile(f["fwd_bwd_all_s"], q), adamw_s=quantile(f["adamw_all_s"], q))
    return out


def slowest_copies(c: dict) -> list:
    """Per step, the slowest copy's forward+backward of a contended floor: the kept list, or (a
    measurement from before it was kept) the per-copy lists that ``fwd_bwd_all_s`` concatenates,
    their steps started together."""
    if "slowest_fwd_bwd_all_s" in c:
        return c["slowest_fwd_bwd_all_s"]
    xs, copies = c["fwd_bwd_all_s"], c["copies"]
    n = len(xs) // copies
    return [max(step) for step in zip(*(xs[i * n:(i + 1) * n] for i in range(copies)))]


def copies_figures(c: dict, q: float, cores: float) -> dict:
    """What ``copies`` one-thread copies of the plain step started together lose (plan_measure's
    ``contended`` or ``oversubscribed`` run of one model): the together/alone ratio beyond the ideal
    share of the cores, both halves taken at the same moments, and the slowest copy per step over the
    median copy ([Note: CPU calibration] in zeroray/plan/calibrate.py)."""
    together = quantile(c["fwd_bwd_all_s"], q)
    if "alone_fwd_bwd_all_s" not in c:
        raise ValueError("the contended floor has no alone half (a measurement older than it): re-measure with "
                         "`--measure-only contended,oversubscribed`")
    alone = quantile(c["alone_fwd_bwd_all_s"], q)
    contention, straggler = contended_figures(together, alone, quantile(slowest_copies(c), q), c["copies"], cores)
    return {"contention": contention, "straggler": straggler, "together_over_alone": together / alone,
            "copies": c["copies"], "share": max(1.0, c["copies"] / cores)}


def contended_for(m: dict, model: str, world: int, cores: float):
    """The contended floor a row of ``world`` workers is calibrated from: one copy per worker where
    they outnumber the cores and the measurement has it (``oversubscribed``), else one per core."""
    over = m.get("oversubscribed", {}).get(str(world), {}).get(model)
    if world > cores and over is not None:
        wall, cpu_s = statistics.median(over["fwd_bwd_all_s"]), statistics.median(over["cpu_fwd_bwd_all_s"])
        if undisturbed(wall, cpu_s, over["copies"], cores):
            return over
        print(f"  {model}/{world}: the floor with {over['copies']} copies is DISTURBED (wall {wall / cpu_s:.2f}x its CPU "
              f"seconds, more than {over['copies']} copies sharing {cores:g} cores explain: other processes held "
              "the cores); read with one copy per core instead")
    return m.get("contended", {}).get(model)


def solo_ratio(solo: dict, stage: int, q: float, cpu_time: bool = True) -> float:
    """The engine's single-process ratio of a stage in an ``engine_solo`` record: from the CPU
    seconds (what the engine adds is work on the worker's thread; the wall times also hold the waits
    for a core that the machine's other load causes), or the wall times."""
    pre = "cpu_" if cpu_time else ""
    return engine_ratio(solo["stages"][str(stage)][pre + "engine_step_all_s"], solo[pre + "fwd_bwd_all_s"],
                        solo[pre + "adamw_all_s"], q)


def run_config(stage: int, world: int, spec: dict) -> plan.RunConfig:
    return plan.RunConfig(stage, world, micro_batch=spec["batch_per_worker"], dtype="fp32", checkpointing=False,
                          optimizer="adamw")


class Calibration:
    """Everything the CPU rows are told about this machine, from ``CALIBRATION_MODELS`` and the tiny
    model only ([Note: held-out split]); ``cluster`` builds a row's cluster from it and the row's
    model and single-process floor."""

    def __init__(self, m: dict, q: float, cores: float, model: str = CALIBRATION_MODELS[0],
                 busy_overlap: Optional[float] = None) -> None:
        self.m, self.q, self.cores, self.model = m, q, cores, model
        self.busy_overlap_given = busy_overlap  # a what-if reading (--busy-overlap), not a calibration
        solo = m.get("engine_solo", {})
        self.engine = {s: solo_ratio(solo[model], s, q) for s in range(4)} if model in solo else {}
        self.worlds = sorted({int(k.split("/")[1]) for k in m["steps"]})
        self.copies = {}
        for world in self.worlds:
            c = contended_for(m, model, world, cores)
            self.copies[world] = copies_figures(c, q, cores) if c else None
        # the optimizer's bandwidth: the calibration model's flat AdamW step, seconds per element
        self.adamw_per_param = {world: m["steps"][f"{model}/{world}"]["floor"]["adamw_s"] /
                                m["steps"][f"{model}/{world}"]["floor"]["params"] for world in self.worlds}
        self.overhead = {}
        for world, rec in m["overhead"].items():
            spec = rec["floor"]["spec"]
            w = bench_workload(spec)
            for name, r in rec.items():
                if name == "floor":
                    continue
                ratio = solo_ratio(solo["tiny"], r["stage"], q) if "tiny" in solo else None
                f = rec["floor"]
                cl = cpu_cluster(w, m["gloo"], int(world), cores, step_s=f["fwd_bwd_s"] * (ratio or 1.0),
                                 adamw_s=f["adamw_s"], params=f["params"], micro_batch=spec["batch_per_worker"],
                                 engine=ratio is not None)
                self.overhead[(int(world), r["stage"])] = (r["median_s"] -
                                                           plan.simulate(w, cl, run_config(r["stage"], int(world), spec)).step_s)

    def cluster(self, w: plan.Workload, floor_s: float, params: int, world: int, stage: int,
                micro_batch: int) -> plan.Cluster:
        """A row's cluster: its model's single-process floor ``floor_s`` times the calibration's
        together/alone ratio at ``world`` workers and its engine ratio at ``stage``; the calibration's
        slowest copy, optimizer bandwidth and fixed per-step cost."""
        c = self.copies.get(world)
        ratio = self.engine.get(stage)
        step = floor_s * (c["contention"] if c else 1.0) * (ratio if ratio is not None else 1.0)
        cl = cpu_cluster(w, self.m["gloo"], world, self.cores, step_s=step, adamw_s=self.adamw_per_param[world] * params,
                         params=params, micro_batch=micro_batch, straggler=c["straggler"] if c else 1.0,
                         engine=ratio is not None)
        return cl.with_(step_overhead_s=self.overhead[(world, stage)], busy_overlap=self.busy_overlap(world))

    def busy_overlap(self, world: int) -> float:
        """The share of a collective hidden beside the compute with every core busy, as measured
        (plan_measure's ``overlap``, clipped to [0, 1]), or without the measurement 1: the overlap of
        any cluster ([Note: hardware presets]); ``--busy-overlap`` replaces either (a what-if)."""
        if self.busy_overlap_given is not None:
            return self.busy_overlap_given
        o = self.overlap(world)
        return min(1.0, max(0.0, o["overlap"])) if o else 1.0

    def overlap(self, world: int):
        """plan_measure's ``overlap`` at ``world`` ranks, or None: not measured, or measured while other
        processes held the cores (the step's wall time beyond what its ranks' own sharing explains)."""
        o = self.m.get("overlap", {}).get(str(world))
        if o is None or undisturbed(o["compute_s"], statistics.median(o["cpu_compute_all_s"]), world, self.cores):
            return o
        return None

    def describe(self) -> None:
        print(f"  calibration set: {self.model} (and the tiny model's fixed per-step cost); held out: {', '.join(HELD_OUT)}")
        for world in self.worlds:
            lat, bw = gloo_ring(self.m["gloo"], world)
            c = self.copies[world]
            line = f"  {world} workers: gloo {lat * 1e3:.2f} ms per hop, {bw / 1e9:.2f} GB/s"
            if c:
                line += (f"; {c['copies']} copies of {self.model}'s step together {c['together_over_alone']:.3f}x alone "
                         f"({c['contention']:.3f}x beyond the share {c['share']:g}), the slowest {c['straggler']:.3f}x")
            line += "; fixed per-step cost " + "/".join(f"{self.overhead[(world, s)] * 1e3:.0f}" for s in range(4)) + " ms"
            print(line)
        if self.busy_overlap_given is not None:
            print(f"  gloo beside the compute with every core busy: {self.busy_overlap_given:g} of the shorter hidden, "
                  "GIVEN (--busy-overlap: a what-if, not this machine's calibration)")
        for world in self.worlds if self.busy_overlap_given is None else ():
            o, raw = self.overlap(world), self.m.get("overlap", {}).get(str(world))
            print(f"  {world} workers, gloo beside the compute with every core busy: " +
                  (f"{o['overlap']:.2f} of the shorter hidden (step {o['compute_s'] * 1e3:.0f} ms, reduce-scatter of "
                   f"{o['mb']:g} MB {o['comm_s'] * 1e3:.0f} ms, both {o['both_s'] * 1e3:.0f} ms; load average "
                   f"{o['load'][0]:.1f})" if o else
                   "DISTURBED (the step's wall time beyond its ranks' sharing of the cores): taken as 1" if raw else
                   "not measured: taken as 1, as on any cluster (`--measure-only overlap` measures it)"))
        if self.engine:
            print(f"  the engine's single-process step over the plain one ({self.model}, CPU seconds), stages 0-3: " +
                  "/".join(f"{self.engine[s]:.3f}" for s in range(4)) + "x")
        else:
            print("  the engine's single-process step: not measured (`--measure-only engine_solo` adds it)")


def cpu(path: str, q: float = 0.5, without: tuple = (), busy_overlap: Optional[float] = None) -> bool:
    """This machine: zr.Trainer steps of stages 0-3 at each world size against the replay on a cluster
    built from the calibration set ([Note: held-out split]); the held-out models' rows are checks."""
    if not os.path.exists(path):
        print(f"this machine (CPU, gloo): no measurement at {path}; run `PYTHONPATH=. python "
              "benchmarks/plan_check.py --measure`")
        return False
    with open(path) as f:
        m = json.load(f)
    for part in without:  # the table as it was before these parts of the calibration were taken
        m.pop(part, None)
    cores = float(m["machine"]["cpus"])
    m["overhead"] = {k: at_quantile(rec, q) for k, rec in m["overhead"].items()}
    m["steps"] = {k: at_quantile(rec, q) for k, rec in m["steps"].items()}
    cal = Calibration(m, q, cores, busy_overlap=busy_overlap)
    load = m["machine"]
    spreads, flops_only = [], []
    for key, rec in m["steps"].items():
        model, world = key.split("/")
        world = int(world)
        f, spec = rec["floor"], rec["floor"]["spec"]
        w = bench_workload(spec)
        held_out = model in HELD_OUT
        for name, r in sorted((n, r) for n, r in rec.items() if n != "floor"):
            stage = r["stage"]
            cfg = run_config(stage, world, spec)
            pred = plan.simulate(w, cal.cluster(w, f["fwd_bwd_s"], f["params"], world, stage, spec["batch_per_worker"]), cfg)
            rounds = r["round_medians_s"]
            spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
            spreads.append(spread)
            note = f"rounds spread {spread:.0%}"
            if held_out:  # the same row with the calibration model's compute rate: the FLOPs alone
                g = m["steps"][f"{cal.model}/{world}"]["floor"]
                gw = bench_workload(g["spec"])
                gcl = cal.cluster(gw, g["fwd_bwd_s"], g["params"], world, stage, g["spec"]["batch_per_worker"])
                by_flops = plan.simulate(w, gcl, cfg).step_s
                flops_only.append(by_flops / r["median_s"] - 1)
                note += f"; FLOPs only {by_flops / r['median_s'] - 1:+.1%}"
            row(f"CPU {model} stage {stage}, {world} workers step s{'' if q == 0.5 else f' (q{q:g})'}"
                + ("" if held_out else " (calibration model)"), pred.step_s, r["median_s"], 0.15, " s",
                calibration=not held_out, note=note)
    print(f"CPU calibration ({os.path.relpath(path, ROOT)}): {cores:.0f} cores, load average "
          f"{load['load_before'][0]:.1f} before and {load['load_after'][0]:.1f} after the measurement; per row, the "
          f"spread of its round medians: median {statistics.median(spreads):.0%}, max {max(spreads):.0%}")
    cal.describe()
    if flops_only:
        print(f"  held out, FLOPs only (no floor of their own: {cal.model}'s compute rate): errors "
              f"{min(flops_only):+.1%} to {max(flops_only):+.1%}")
    return True


# fits.py's runs (benchmarks/README.md, "Optimizer state on disk"): 2 workers, GPT d_model 512, 8 heads, 64
# tokens x 2 sequences per worker, AdamW, a 1000 MB cap on each worker's peak RSS. Per row: the file, the
# in-memory row (calibration) and the offload="disk" row (the check), both from one fits.py run on the same code
# (construction on a thread of its own: [Note: construction's arena] in zeroray/memory/process.py, which changes
# the in-memory path too). The earlier files (fits_stage3_fresh_state.json, fits_stage3_shard_offload.json,
# fits_bf16_offload.json) hold the rows before it; docs/planning.md has both.
FITS_RUNS = (
    ("fits_offload2_stage3_fp32.json", ("fp32",), "zr3@2", "zr3+disk@2", 3, "fp32"),
    ("fits_offload2_stage3_bf16.json", ("bf16",), "zr3@2", "zr3+disk@2", 3, "bf16"),
    ("fits_offload2_stage1_bf16.json", ("bf16",), "zr1@2", "zr1+disk@2", 1, "bf16"),
)
FITS_CAP = 1000e6


def fits_peaks(rec: dict) -> dict:
    """Layers -> peak RSS bytes of one fits.py row (``peaks`` in bytes, or ``peaks_mb``)."""
    if "peaks" in rec:
        return {int(k): float(v) for k, v in rec["peaks"].items()}
    return {int(k): float(v) * 1e6 for k, v in rec["peaks_mb"].items()}


def fits_offload() -> None:
    """fits.py's offload="disk" rows: the largest model under the cap, predicted by the footprint.

    A worker's peak RSS is its process's baseline (Python, torch, Ray, the collective group) plus what
    training allocates; the footprint predicts the second ([Note: peak memory]: ``total`` less the
    context). The baseline is the one figure calibrated, on the in-memory row of the same run: the
    mean over its points of the measured peak less the footprint. The offload row is then predicted
    from its own footprint and that baseline; it is the check."""
    from common import BenchSpec

    results = os.path.join(ROOT, "benchmarks", "results")

    def footprint(layers: int, stage: int, dtype: str, offload) -> float:
        spec = BenchSpec(d_model=512, n_layers=layers, n_heads=8, seq_len=64, batch_per_worker=2, num_workers=2)
        w = bench_workload(spec.as_dict())
        r = plan.simulate(w, plan.cluster_preset("cpu", gpus_per_node=2, cores=2.0, context_bytes=0.0),
                          plan.RunConfig(stage, 2, micro_batch=2, dtype=dtype, checkpointing=False, optimizer="adamw",
                                         offload=offload))
        return r.memory["total"]

    for fname, path, mem_key, disk_key, stage, dtype in FITS_RUNS:
        with open(os.path.join(results, fname)) as f:
            data = json.load(f)
        for k in path:
            data = data[k]
        mem, disk = data[mem_key], data[disk_key]
        mem_peaks = fits_peaks(mem)
        base = statistics.mean(p - footprint(n, stage, dtype, None) for n, p in mem_peaks.items())
        label = f"{fname.split('.')[0]}:{'/'.join(path)}"
        for name, rec, offload in ((mem_key, mem, None), (disk_key, disk, "disk")):
            largest = 0
            while base + footprint(largest + 1, stage, dtype, offload) <= FITS_CAP and largest < 400:
                largest += 1
            measured = rec["layers"]
            peaks = fits_peaks(rec)
            at = peaks.get(measured)
            note = (f"baseline {base / 1e6:.0f} MB from the in-memory row; peak at {measured} layers "
                    f"{at / 1e6:.0f} MB measured, {(base + footprint(measured, stage, dtype, offload)) / 1e6:.0f} "
                    "predicted" if at else f"baseline {base / 1e6:.0f} MB")
            row(f"fits.py {dtype} stage {stage}{' offload=disk' if offload else ''}, 2 workers: largest GPT "
                f"(d 512) layers under 1000 MB peak RSS ({label})", largest, measured, 0.15,
                calibration=offload is None, note=note)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true",
                   help="first measure this machine (benchmarks/plan_measure.py: real Trainer steps, gloo, the "
                        "single-process floor) and write --measured; without it the CPU rows read that file")
    p.add_argument("--measure-contention", action="store_true",
                   help="measure only the floor with every core busy and add it to --measured (the rest kept); "
                        "the same as --measure-only contended")
    p.add_argument("--measure-only", default="", metavar="PARTS",
                   help="measure only these calibration parts, comma-separated, and add them to --measured (the "
                        "rest kept): contended (one copy per core), oversubscribed (one copy per worker where "
                        "--workers outnumber the cores), engine_solo (the engine's single-process step), overlap (gloo "
                        "beside the compute with every core busy)")
    p.add_argument("--without", default="", metavar="PARTS",
                   help="read the measurement without these calibration parts (comma-separated: contended, "
                        "oversubscribed, engine_solo): the table as it was before they were taken")
    p.add_argument("--measured", "--from", dest="measured", default=None,
                   help="the JSON of the CPU measurement to read (and to write with --measure); the table is "
                        "recomputed from it in seconds (default benchmarks/results/plan_cpu_measured.json)")
    p.add_argument("--rounds", type=int, default=2, help="--measure: rounds, fresh trainers each (default 2)")
    p.add_argument("--steps", type=int, default=6, help="--measure: timed steps per round (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="--measure: untimed steps before them (default 2)")
    p.add_argument("--models", default="gpt,mha,hf-gpt2", help="--measure: models of compare.py")
    p.add_argument("--quantile", type=float, default=0.5,
                   help="CPU rows: compare this quantile of the measured steps, the floor's included (default 0.5, "
                        "the median; on a loaded machine a low one is the least-disturbed estimate of both sides)")
    p.add_argument("--workers", default="2,3", help="--measure: world sizes")
    p.add_argument("--busy-overlap", type=float, default=None, metavar="SHARE",
                   help="CPU rows, a what-if: the share of a collective hidden beside the compute with every core "
                        "busy, in place of the measured one (or 1 unmeasured); 0: none hidden")
    args = p.parse_args(argv)
    import plan_measure

    path = args.measured or plan_measure.OUT
    parts = [x for x in args.measure_only.split(",") if x] + (["contended"] if args.measure_contention else [])
    unknown = sorted(set(parts) - {"contended", "oversubscribed", "engine_solo", "overlap"})
    if unknown:
        p.error(f"--measure-only {','.join(unknown)}: choose among contended, oversubscribed, engine_solo, overlap")
    if parts and not args.measure:
        with open(path) as f:
            kept = json.load(f)
        models, worlds = tuple(args.models.split(",")), tuple(int(w) for w in args.workers.split(","))
        for part in parts:
            kept[part] = (plan_measure.measure_contention(models) if part == "contended" else
                          plan_measure.measure_oversubscribed(models, worlds) if part == "oversubscribed" else
                          plan_measure.measure_overlap(worlds) if part == "overlap" else
                          plan_measure.engine_solo(models))
            kept.setdefault("added", {})[part] = {"at": time.time(), "load": os.getloadavg()}
        with open(path, "w") as f:
            json.dump(kept, f, indent=1)
    if args.measure:
        plan_measure.measure(models=tuple(args.models.split(",")), worlds=tuple(int(w) for w in args.workers.split(",")),
                             rounds=args.rounds, steps=args.steps, warmup=args.warmup, out=path)
    published()
    h200()
    measured = cpu(path, args.quantile, tuple(x for x in args.without.split(",") if x), args.busy_overlap)
    fits_offload()
    print_table("CHECKS (counted)", CHECKS)
    print_table("CALIBRATION (the inputs' sources and rows that cannot fail: never counted)", CALIBRATION)
    if not measured:
        print("this machine (CPU, gloo): stages 0-3 at 2 and 3 workers on gpt, mha, hf-gpt2: NOT MEASURED (missing)")
    out = sum(1 for r in CHECKS if r[5] != "ok")
    print(f"{len(CHECKS) - out} of {len(CHECKS)} checks within their bounds ({len(CALIBRATION)} calibration rows "
          "apart, not counted)")
    return 0


def print_table(title: str, rows: list) -> None:
    cols = ("row", "predicted", "published/measured", "error", "bound", "", "note")
    widths = [max(len(str(r[i])) for r in rows + [cols]) for i in range(len(cols))]
    print(f"\n{title}")
    for r in [cols] + rows:
        print("  ".join(str(c).ljust(w) if i in (0, 6) else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())


if __name__ == "__main__":
    sys.exit(main())
