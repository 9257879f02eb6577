"""Predicted vs published or measured: every check of zeroray.plan's step simulator in one table.

    PYTHONPATH=. python benchmarks/plan_check.py

Rows (docs/planning.md says what the simulator models):
- the ZeRO paper from its hardware alone (v100-32gb preset: DGX-2, 800 Gb/s between nodes), the four
  headline results of shared/reference/scale-anchors.md plus Table 1's example;
- the H200 evidence (808M bf16, world 1): compute calibrated from the plain PyTorch step, the rest predicted;
- torchtitan's Llama 3.1 8B FSDP on H100 (bf16, no compile, local batch 2 x 8192, 96 GB HBM2e at 500 W).
The CPU rows of this machine (stages 0-3 at 2 and 3 workers on gpt, mha, hf-gpt2) read
benchmarks/results/plan_cpu_measured.json (``--measure`` takes it; ``--measure-only PARTS`` adds only
calibration parts to a kept measurement; ``--from PATH`` reads another, in seconds; ``--without PARTS``
recomputes the table without parts of the calibration, as it was before they were taken); without
it they are listed as missing rather than guessed. The cluster is built by
zeroray/plan/calibrate.py ([Note: CPU calibration]).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from zeroray import plan  # noqa: E402
from zeroray.memory import model as memory  # noqa: E402
from zeroray.plan.calibrate import (contended_figures, cpu_cluster, engine_ratio, gloo_ring, quantile,  # noqa: E402
                                    undisturbed)
from zeroray.plan.planner import max_micro_batch  # noqa: E402

ROWS = []


def row(name: str, predicted: float, published: float, bound: float, unit: str = "", side: str = "") -> None:
    """``side``: "<=" or ">=" when the published figure is a bound the prediction must respect."""
    err = predicted / published - 1
    ok = abs(err) <= bound or (side == ">=" and predicted >= published) or (side == "<=" and predicted <= published)
    ROWS.append((name, f"{predicted:,.4g}{unit}", f"{published:,.4g}{unit}", f"{err:+.1%}",
                 f"±{bound:.0%}" + (f" or {side}" if side else ""), "ok" if ok else "OUT"))


def gpt_shape(layers: int, hidden: int, seq: int = 1024, vocab: int = 50257) -> plan.Workload:
    w = plan.from_params(12 * layers * hidden * hidden, seq_len=seq, vocab=vocab)
    units = (w.units[0],) + tuple(replace(w.units[1], name=f"layers.{i}", params=12 * hidden * hidden + 13 * hidden,
                                          matmul_params=12 * hidden * hidden) for i in range(layers))
    units += (replace(w.units[-1], params=2 * hidden, matmul_params=vocab * hidden),)
    return plan.Workload(f"gpt-{layers}x{hidden}", units, hidden, hidden // 128, seq, vocab, layers)


def paper() -> None:
    v100 = plan.cluster_preset("v100-32gb")
    w = plan.from_params(7.5e9)
    for stage, gb in zip(range(4), (120, 31.4, 16.6, 1.88)):
        r = plan.simulate(plan.Workload(w.name, w.units, w.hidden, w.heads, w.seq_len, w.vocab, w.layers), v100,
                          plan.RunConfig(stage, 64, dtype="fp16"))
        states = memory.estimate_memory(7.5e9, 64, stage, "fp16") / 1e9
        row(f"paper Table 1: 7.5B, 64 GPUs, stage {stage} model states GB", states, gb, 0.2)
        del r
    largest = plan.largest_models(v100, 64, dtype="fp16", seq_len=1024, micro_batch=1, checkpointing=True)
    row("paper: largest plain-DP (stage 0) model on 32 GB, params", largest["0"], 1.4e9, 0.2)
    largest400 = plan.largest_models(v100, 400, dtype="fp16", seq_len=1024, micro_batch=1, checkpointing=True)
    row("paper: largest stage-2 model without MP, 400 GPUs (>= 13B)", largest400["2"], 13e9, 0.2, side=">=")

    def tflops(layers: int, hidden: int, gpus: int) -> float:
        wl = gpt_shape(layers, hidden)
        # the paper's ZeRO reduces the fp16 gradients (zeroray reduces in fp32 unless told)
        cfg = plan.RunConfig(2, gpus, dtype="fp16", tp=16, checkpointing=True, reduce_dtype="fp16")
        mb = max_micro_batch(wl, v100, cfg, limit=64)
        r = plan.simulate(wl, v100, replace(cfg, micro_batch=max(mb, 1)))
        # the paper counts the recomputed forward too (Megatron-LM's convention): 8/6 of model FLOPs
        return r.mfu * v100.peak_flops * 8 / 6 / 1e12, mb

    t100, mb100 = tflops(125, 8192, 400)
    row(f"paper: 100B (125x8192, MP16, stage 2) on 400 GPUs, TFLOP/s per GPU (micro-batch {mb100})", t100, 38, 0.2)
    t64, mb64 = tflops(75, 8192, 64)
    t128, mb128 = tflops(75, 8192, 128)
    row(f"paper: 60B super-linear, 128 vs 64 GPUs aggregate throughput (micro-batch {mb64} -> {mb128}) (> 2)",
        2 * t128 / t64, 2.0, 0.2, side=">=")


def h200() -> None:
    import gpt

    cfg = gpt.GPTConfig(d_model=2048, n_layers=16, n_heads=16, seq_len=1024)
    w = plan.from_module(lambda: gpt.GPT(cfg), seq_len=1024, hidden=2048, heads=16)
    base = plan.cluster_preset("h200", gpus_per_node=1)
    run = plan.RunConfig(0, 1, micro_batch=8, dtype="bf16", checkpointing=False, optimizer="adamw")
    # calibrate: the plain PyTorch step (0.0934 s) fixes ``achieved``
    probe = plan.simulate(w, base, run)
    compute_only = probe.compute_s
    achieved = base.achieved * compute_only / (0.0934 - probe.optimizer_s)
    cal = replace(base, achieved=achieved)
    solo = replace(cal, launch_s=0.0)
    print(f"H200 calibration: achieved {achieved:.3f} of peak from the plain step ({w.params / 1e6:.0f}M params)")
    row("H200 808M plain step s (calibration point)", plan.simulate(w, solo, run).step_s, 0.0934, 0.15, " s")
    for stage, measured in ((1, 0.0938), (3, 0.0994)):
        r = plan.simulate(w, solo, replace(run, stage=stage))
        row(f"H200 808M SoloGroup stage {stage} step s", r.step_s, measured, 0.15, " s")
    for stage, measured in ((1, 0.0977), (3, 0.1384)):
        r = plan.simulate(w, cal, replace(run, stage=stage))
        row(f"H200 808M NCCL world-1 stage {stage} step s ({r.collectives} collectives)", r.step_s, measured, 0.15, " s")
    r = plan.simulate(w, solo, replace(run, stage=3))
    # gpu_check's peak is torch.cuda.max_memory_allocated: what the allocator handed out, without
    # the CUDA context or fragmentation; the footprint's "allocated" is the same quantity
    row("H200 808M stage 3 allocated peak GiB (max_memory_allocated 22.04, gpu_check)",
        r.memory["allocated"] / 2**30, 22.04, 0.15, " GiB")


# Dense BF16 peaks (NVIDIA's H100 datasheet): SXM 989 TFLOP/s, NVL 835 (1,671 with sparsity). torchtitan's
# GPUs are "HBM2e-based SXM H100 with lower TDP [500 W], the actual peak TFLOPs number is between SXM and
# NVL, and we don't know its exact value" (benchmarks/llama3_h100_202412_torchtitan.md, footnote 2).
H100_SXM_PEAK, H100_NVL_PEAK = 989e12, 835e12


def titan_recompute(w: plan.Workload, cfg: dict) -> float:
    """The share of the forward that torchtitan's selective (op) activation checkpointing recomputes:
    it saves every op's output "except every second mm" of a block (torchtitan/distributed/
    activation_checkpoint.py), so of a Llama block's matmuls in call order (wq, wk, wv, wo, w1, w3, w2)
    wk, wo and w3 run again in backward; attention (sdpa) is saved."""
    h, heads, kv, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    head_dim = h // heads
    recomputed = 2 * (h * kv * head_dim + h * heads * head_dim + h * inter) * w.layers  # FLOPs per token
    return recomputed / (w.flops_per_token / 3)


def torchtitan() -> None:
    """Llama 3.1 8B, FSDP, local batch 2 x 8192, selective (op) checkpointing, bf16 params and fp32
    reductions (torchtitan's default mixed_precision_reduce), on Grand Teton H100s: 96 GB HBM2e at
    2.4 TB/s, 500 W, 400 Gb/s per GPU between hosts (all from the benchmark's page)."""
    w = plan.model_preset("llama3-8b", seq_len=8192)
    recompute = titan_recompute(w, plan.MODEL_PRESETS["llama3-8b"])
    mid = (H100_SXM_PEAK + H100_NVL_PEAK) / 2
    h100 = plan.cluster_preset("h100", memory_bytes=96e9, hbm_bw=2.4e12 * 0.8)
    for gpus, published in ((8, 5762), (128, 5605)):
        cfg = plan.RunConfig(3, gpus, micro_batch=2, dtype="bf16", checkpointing=False, recompute=recompute)
        bounds = [plan.simulate(w, h100.with_(peak_flops=p), cfg).tokens_per_s_per_gpu for p in (H100_NVL_PEAK, H100_SXM_PEAK)]
        r = plan.simulate(w, h100.with_(peak_flops=mid), cfg)
        row(f"torchtitan Llama-3.1-8B FSDP {gpus} H100 tokens/s/GPU (SAC recomputes {recompute:.0%} of fwd; "
            f"peak NVL..SXM: {bounds[0]:,.0f}..{bounds[1]:,.0f})", r.tokens_per_s_per_gpu, published, 0.2)


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


def contention(c: dict, floor: dict, q: float, cores: float) -> dict:
    """The floor figures a row's cluster is calibrated from, with every core busy (plan_measure's
    ``contended``, or ``oversubscribed`` with one copy per worker where the workers outnumber the
    cores): the forward+backward is the row's own lone floor (taken between the row's steps) times
    the together/alone ratio of the contended run (both halves at the same moments) less the ideal
    share of the cores that the replay holds, or, for a measurement without the alone half, the
    contended run's own; ``straggler`` is the slowest copy of each step over the median copy
    ([Note: CPU calibration] in zeroray/plan/calibrate.py)."""
    together = quantile(c["fwd_bwd_all_s"], q)
    out = {"lone_fwd_bwd_s": floor["fwd_bwd_s"], "adamw_s": quantile(c["adamw_all_s"], q),
           "straggler": max(1.0, quantile(slowest_copies(c), q) / together), "fwd_bwd_s": together,
           "copies": c["copies"]}
    if "alone_fwd_bwd_all_s" in c:
        out["contention"], out["straggler"] = contended_figures(
            together, quantile(c["alone_fwd_bwd_all_s"], q), quantile(slowest_copies(c), q), c["copies"], cores)
        out["fwd_bwd_s"] = floor["fwd_bwd_s"] * out["contention"]
        out["together_over_alone"] = together / quantile(c["alone_fwd_bwd_all_s"], q)
    return out


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


def row_cluster(rec: dict, w: plan.Workload, m: dict, world: int, cores: float, solo: dict, stage: int,
                q: float) -> plan.Cluster:
    """A row's cluster: its floor (contended) times the engine's single-process ratio of its stage
    where measured (else the plain step's)."""
    f = rec["floor"]
    ratio = solo_ratio(solo, stage, q) if solo else None
    f.setdefault("engine_ratio", {})[stage] = ratio
    step = f["fwd_bwd_s"] * (ratio if ratio is not None else 1.0)
    return cpu_cluster(w, m["gloo"], world, cores, step_s=step, adamw_s=f["adamw_s"], params=f["params"],
                       micro_batch=f["spec"]["batch_per_worker"], straggler=f.get("straggler", 1.0),
                       engine=ratio is not None)


def cpu(path: str, q: float = 0.5, without: tuple = ()) -> bool:
    """This machine: zr.Trainer steps of stages 0-3 at each world size measured against the replay on
    a cluster built from measured constants (zeroray/plan/calibrate.py's cpu_cluster), plus the fixed
    per-step cost of each stage measured on a tiny model: its measured step less what the replay
    predicts for it."""
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
    solo = m.get("engine_solo", {})
    # Workers filling every core compute at the cores' shared speed, not one process's alone, and a
    # step moves at its slowest rank's pace: both from the floor measured with every core busy.
    for key, rec in m["steps"].items():
        model, world = key.split("/")
        c = contended_for(m, model, int(world), cores)
        if c:
            rec["floor"] = dict(rec["floor"], **contention(c, rec["floor"], q, cores))
    cfg = lambda stage, world, spec: plan.RunConfig(stage, world, micro_batch=spec["batch_per_worker"], dtype="fp32",
                                                    checkpointing=False, optimizer="adamw")
    overhead = {}
    for world, rec in m["overhead"].items():
        spec = rec["floor"]["spec"]
        w = bench_workload(spec)
        for name, r in rec.items():
            if name != "floor":
                cl = row_cluster(rec, w, m, int(world), cores, solo.get("tiny"), r["stage"], q)
                overhead[(int(world), r["stage"])] = r["median_s"] - plan.simulate(w, cl, cfg(r["stage"], int(world), spec)).step_s
    spreads = []
    for key, rec in m["steps"].items():
        model, world = key.split("/")
        world = int(world)
        spec = rec["floor"]["spec"]
        w = bench_workload(spec)
        for name, r in sorted((n, r) for n, r in rec.items() if n != "floor"):
            stage = r["stage"]
            cl = row_cluster(rec, w, m, world, cores, solo.get(model), stage, q)
            pred = plan.simulate(w, cl.with_(step_overhead_s=overhead[(world, stage)]), cfg(stage, world, spec))
            rounds = r["round_medians_s"]
            spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
            spreads.append(spread)
            row(f"CPU {model} stage {stage}, {world} workers step s{'' if q == 0.5 else f' (q{q:g})'} (rounds spread {spread:.0%}; fixed "
                f"{overhead[(world, stage)] * 1e3:.0f} ms)", pred.step_s, r["median_s"], 0.15, " s")
    load = m["machine"]
    print(f"CPU calibration ({path}): {cores:.0f} cores, load average {load['load_before'][0]:.1f} before and "
          f"{load['load_after'][0]:.1f} after the measurement; per row, the spread of its round medians: "
          f"median {statistics.median(spreads):.0%}, max {max(spreads):.0%}")
    for world in sorted({int(k.split('/')[1]) for k in m["steps"]}):
        lat, bw = gloo_ring(m["gloo"], world)
        print(f"  gloo exchange, {world} ranks: {lat * 1e3:.2f} ms per hop, {bw / 1e9:.2f} GB/s")
    for name, r in solo.items():
        print(f"  {name}: the engine's single-process step over the plain one (AdamW aside), CPU seconds (wall): " +
              ", ".join(f"stage {s} {solo_ratio(r, int(s), q):.3f}x ({solo_ratio(r, int(s), q, cpu_time=False):.3f}x)"
                        for s in r["stages"]) + f" (load average {r['load'][0]:.1f})")
    if not solo:
        print("  the engine's single-process step: not measured (the compute is the plain step's; "
              "`--measure-only engine_solo` adds it)")
    for key, rec in m["steps"].items():
        f = rec["floor"]
        world = int(key.split("/")[1])
        lone = f" (alone {f['lone_fwd_bwd_s'] * 1e3:.0f} ms)" if "lone_fwd_bwd_s" in f else ""
        if "contention" in f:
            share = max(1.0, f["copies"] / cores)
            lone += f", {f['copies']} copies together {f['together_over_alone']:.3f}x alone"
            if share > 1:
                lone += f" ({f['together_over_alone'] / share:.3f}x beyond the share {share:g})"
            if f["together_over_alone"] / share < 1:  # contended_figures' lower bound
                lone += " (read as 1: sharing cannot speed a copy up; the alone half was disturbed)"
            if f["contention"] > 1.5:  # one copy per core cannot halve the speed: the copies shared a core
                lone += " (SUSPECT: the copies did not each have a core; re-measure on a quiet machine)"
        if world > cores and f.get("copies", 0) < world:
            lone += f" (no floor with {world} copies: `--measure-only oversubscribed` adds it)"
        if "straggler" in f:
            lone += f", the slowest rank {f['straggler']:.3f}x"
        if any(x is not None for x in f.get("engine_ratio", {}).values()):
            lone += ", the engine " + "/".join(f"{f['engine_ratio'][s]:.3f}" for s in sorted(f["engine_ratio"])) + "x"
        print(f"  {key}: floor forward+backward {f['fwd_bwd_s'] * 1e3:.0f} ms{lone}, AdamW {f['adamw_s'] * 1e3:.1f} ms "
              f"({f['params'] / 1e6:.2f}M params)")
    return True


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
                        "--workers outnumber the cores), engine_solo (the engine's single-process step)")
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
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_measure

    path = args.measured or plan_measure.OUT
    parts = [x for x in args.measure_only.split(",") if x] + (["contended"] if args.measure_contention else [])
    unknown = sorted(set(parts) - {"contended", "oversubscribed", "engine_solo"})
    if unknown:
        p.error(f"--measure-only {','.join(unknown)}: choose among contended, oversubscribed, engine_solo")
    if parts and not args.measure:
        with open(path) as f:
            kept = json.load(f)
        models, worlds = tuple(args.models.split(",")), tuple(int(w) for w in args.workers.split(","))
        for part in parts:
            kept[part] = (plan_measure.measure_contention(models) if part == "contended" else
                          plan_measure.measure_oversubscribed(models, worlds) if part == "oversubscribed" else
                          plan_measure.engine_solo(models))
            kept.setdefault("added", {})[part] = {"at": time.time(), "load": os.getloadavg()}
        with open(path, "w") as f:
            json.dump(kept, f, indent=1)
    if args.measure:
        plan_measure.measure(models=tuple(args.models.split(",")), worlds=tuple(int(w) for w in args.workers.split(",")),
                             rounds=args.rounds, steps=args.steps, warmup=args.warmup, out=path)
    paper()
    h200()
    torchtitan()
    measured = cpu(path, args.quantile, tuple(x for x in args.without.split(",") if x))
    cols = ("check", "predicted", "published/measured", "error", "bound", "")
    widths = [max(len(str(r[i])) for r in ROWS + [cols]) for i in range(len(cols))]
    for r in [cols] + ROWS:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if not measured:
        print("this machine (CPU, gloo): stages 0-3 at 2 and 3 workers on gpt, mha, hf-gpt2: NOT MEASURED (missing)")
    out = sum(1 for r in ROWS if r[-1] != "ok")
    print(f"{len(ROWS) - out} of {len(ROWS)} within their bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
