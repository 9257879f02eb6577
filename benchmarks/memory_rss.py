"""Where a worker's resident memory goes, per ZeRO stage, beside torch DDP and FSDP2.

    python benchmarks/memory_rss.py [--model gpt|mha|hf-gpt2] [--large | --d-model D --layers L --heads H]
        [--seq-len 128] [--workers 2] [--steps 3]
        [--only ddp,fsdp2,zr0,zr1,zr2,zr3] [--ray-env KEY=VALUE ...] [--zero JSON] [--json out.json]

Every row trains the same model (``--model``: examples/gpt.py's GPT, or one zeroray did not
write, see bench_models.py) for ``--steps`` steps from the same weights on
the same batches, one row after another, one thread per worker (as compare.py). For zeroray
each worker's ``memory_report()['rss']`` breaks its peak RSS over the steps into the process
baseline, the model states (measured, equal to the estimate), the stage-3 gathered window, the
bucket and staging pools, the activations at the end of forward, and the rest ("other":
temporaries, later imports, allocator slack); see [Note: RSS breakdown] in
zeroray/memory/report.py. Construction's own peak and the slack at rest come beside it, and
the communication the last step left exposed (comm_report's exposed_s, a wall time: it moves
with the machine's load) and, at stage 3, how many of its unit gathers the prefetch window
did not cover (fetched on demand): what the window buys. The
torch rows report their baseline (RSS after process-group setup, before the model), their
peak RSS and the model states of the paper's formula (DDP: stage 0, FSDP2: stage 3).

Under the table, the issue's two targets: stage 3's peak below DDP's, and each stage's saving
against stage 0 (worst worker against worst worker) as a share of what the paper's formula
predicts (at least 90%). ``--ray-env`` starts the embedded Ray with those variables in the
workers' environment (``MALLOC_ARENA_MAX=2``, ``LD_PRELOAD=<ray's jemalloc>``), to measure an
allocator setting; ``--zero`` adds ZeroConfig fields to every zeroray row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from common import BENCHMARKS, EXAMPLES, ROOT, BenchSpec, add_import_paths, global_batches, model_fn  # noqa: E402

ROWS = ("ddp", "fsdp2", "zr0", "zr1", "zr2", "zr3")
MB = 1e6
TARGET_SHARE = 0.90  # of the formula's saving against stage 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "mha", "hf-gpt2"), default="gpt",
                   help="the model every row trains (bench_models.py; default gpt)")
    p.add_argument("--large", action="store_true", help="d_model 512, 8 layers, 8 heads (25.4M parameters)")
    p.add_argument("--d-model", type=int, help="default 256 (512 with --large)")
    p.add_argument("--layers", type=int, help="default 4 (8 with --large)")
    p.add_argument("--heads", type=int, help="default 4 (8 with --large)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per worker (default 8)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per row (default 3: the optimizer state "
                                                        "exists from the first, the trace from the second)")
    p.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    p.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the zeroray workers (repeatable)")
    p.add_argument("--zero", default="{}", help="JSON of ZeroConfig fields for every zeroray row")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a torch row is killed")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    args.rows = [r for r in ROWS if r in {x.strip() for x in args.only.split(",")}]
    args.env = dict(kv.split("=", 1) for kv in args.ray_env)
    args.zero_fields = json.loads(args.zero)
    return args


def make_spec(args) -> BenchSpec:
    d, layers, heads = (512, 8, 8) if args.large else (256, 4, 4)
    return BenchSpec(d_model=args.d_model or d, n_layers=args.layers or layers, n_heads=args.heads or heads,
                     seq_len=args.seq_len, batch_per_worker=args.batch, num_workers=args.workers, threads=1,
                     warmup_steps=0, timed_steps=args.steps, model=args.model)


# --------------------------------------------------------------------------- rows

def run_torch(row: str, spec: BenchSpec, num_params: int, timeout_s: float) -> dict:
    import peers
    from zeroray.memory import model as memory

    ranks = peers.launch(row, spec, nprocs=spec.num_workers, timeout_s=timeout_s)
    stage = 0 if row == "ddp" else 3
    model = memory.model_state_bytes(num_params, spec.num_workers, stage, "fp32", "adamw").total
    out = []
    for r in ranks:
        base, peak = r["base_rss_bytes"], r["peak_rss_bytes"]
        out.append({"baseline": base, "model_states": model, "other": peak - base - model,
                    "step_peak": None, "peak_rss": peak})
    return {"workers": out, "losses": [sum(r["losses"][i] for r in ranks) / len(ranks)
                                       for i in range(len(ranks[0]["losses"]))]}


class ZerorayRows:
    """One embedded Ray (started here, with ``env`` in the workers' environment) for every stage."""

    def __init__(self, env: dict) -> None:
        add_import_paths()
        paths = [EXAMPLES, BENCHMARKS, ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": dict(env)} if env else None)

    def run(self, stage: int, spec: BenchSpec, zero_fields: dict) -> dict:
        import bench_models

        import zeroray as zr

        trainer = zr.Trainer(model_fn(spec), bench_models.lm_loss,
                             optimizer=zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                             zero=zr.ZeroConfig(stage=stage, **zero_fields),
                             scaling=zr.ScalingConfig(num_workers=spec.num_workers, threads_per_worker=1),
                             seed=spec.seed)
        try:
            losses = [float(trainer.step(batch).loss) for batch in global_batches(spec)]
            reports = trainer.memory_report()
            comm = trainer.comm_report()
            exposed = max(c.get("exposed_s", 0.0) for c in comm)
            on_demand = max(c.get("on_demand", 0) for c in comm)  # stage 3: gathers the window did not cover
        finally:
            trainer.shutdown()
        workers = []
        for rep in reports:
            # A zeroray without the breakdown (before issue 17): the parts its report has.
            rss = dict(rep.get("rss") or {
                "peak_rss": rep.get("peak_rss_bytes"), "model_states": rep["measured"]["total"],
                "gathered_window": rep.get("gathered_params_peak"), "buckets": rep.get("bucket_buffers"),
                "activations": rep.get("activations_peak")})
            rss["estimate"] = rep["estimate"]["total"]
            rss["paper"] = rep["paper"]["total"]
            workers.append(rss)
        return {"workers": workers, "losses": losses, "exposed_s": exposed, "on_demand": on_demand}

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()


def plain_torch_rss() -> int:
    """RSS of a fresh ``python -c 'import torch'``: what a process needs before Ray and the model."""
    code = ("import torch\nwith open('/proc/self/statm') as f: "
            "print(int(f.read().split()[1]) * __import__('os').sysconf('SC_PAGE_SIZE'))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


# --------------------------------------------------------------------------- output

COLUMNS = (("baseline", "baseline"), ("model_states", "model"), ("gathered_window", "window"),
           ("buckets", "buckets"), ("activations", "activ."), ("other", "other"), ("step_peak", "step peak"),
           ("construction_peak", "constr. peak"), ("peak_rss", "PEAK RSS"), ("slack_at_rest", "slack@rest"))


def worst(rec: dict) -> dict:
    """The worker with the largest peak RSS (the one a per-worker memory cap would stop)."""
    return max(rec["workers"], key=lambda w: w.get("peak_rss") or 0)


def table(records: dict) -> str:
    header = ["row"] + [title for _, title in COLUMNS] + ["exposed s", "on demand"]
    lines = []
    for name, rec in records.items():
        if "error" in rec:
            lines.append([name, "FAILED: " + rec["error"][:90]])
            continue
        w = worst(rec)
        exposed = f"{rec['exposed_s']:.3f}" if rec.get("exposed_s") is not None else "-"
        demand = str(rec["on_demand"]) if rec.get("on_demand") else "-"
        lines.append([name] + ["-" if w.get(k) is None else f"{w[k] / MB:.0f}" for k, _ in COLUMNS]
                     + [exposed, demand])
    widths = [max(len(r[i]) for r in [header, *lines] if i < len(r)) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in lines]
    return "\n".join(out)


def targets(records: dict, spec: BenchSpec, num_params: int) -> list:
    from zeroray.memory import model as memory

    lines = []
    ok = {k: r for k, r in records.items() if "error" not in r}
    if "zr3" in ok and "ddp" in ok:
        a, b = worst(ok["zr3"])["peak_rss"], worst(ok["ddp"])["peak_rss"]
        lines.append(f"stage 3 peak RSS {a / MB:.0f} MB vs DDP {b / MB:.0f} MB per worker: "
                     f"{'met' if a < b else 'NOT met'} (target: below DDP's)")
    if "zr0" in ok:
        base = worst(ok["zr0"])["peak_rss"]
        formula0 = memory.model_state_bytes(num_params, spec.num_workers, 0, "fp32", "adamw").total
        for stage in (1, 2, 3):
            row = ok.get(f"zr{stage}")
            if row is None:
                continue
            saved = base - worst(row)["peak_rss"]
            predicted = formula0 - memory.model_state_bytes(num_params, spec.num_workers, stage, "fp32", "adamw").total
            share = saved / predicted
            lines.append(f"stage {stage} saves {saved / MB:.0f} MB of the {predicted / MB:.0f} MB its formula "
                         f"predicts against stage 0: {share:.1%} ({'met' if share >= TARGET_SHARE else 'NOT met'}, "
                         f"target >= {TARGET_SHARE:.0%})")
    return lines


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = make_spec(args)
    add_import_paths()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    from common import limit_threads, num_params as count

    limit_threads(1)
    num_params = count(spec)
    load = os.getloadavg()
    log(f"{spec.model} d_model={spec.d_model} layers={spec.n_layers} heads={spec.n_heads} ({num_params / 1e6:.2f}M params), "
        f"{spec.num_workers} workers x {spec.batch_per_worker} seqs, {spec.timed_steps} steps; "
        f"zeroray env {args.env or '-'}, ZeroConfig {args.zero_fields or '-'}; load average {load[0]:.2f}")
    records, session = {}, None
    try:
        for row in args.rows:
            log(f"[{row}] running ...")
            t0 = time.perf_counter()
            try:
                if row.startswith("zr"):
                    session = session or ZerorayRows(args.env)
                    records[row] = session.run(int(row[2:]), spec, args.zero_fields)
                else:
                    records[row] = run_torch(row, spec, num_params, args.timeout)
            except Exception as e:  # noqa: BLE001 - the row says FAILED, the others still run
                traceback.print_exc()
                records[row] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            log(f"[{row}] {time.perf_counter() - t0:.0f}s")
    finally:
        if session is not None:
            session.close()
    plain = plain_torch_rss()
    print(f"MB per worker, the worker with the largest peak; {spec.model}, {num_params / 1e6:.2f}M parameters, "
          f"{spec.num_workers} workers (a plain `import torch` process: {plain / MB:.0f} MB)")
    print(table(records))
    for line in targets(records, spec, num_params):
        print(line)
    losses = {k: r["losses"][-1] for k, r in records.items() if "losses" in r}
    if len({round(v, 4) for v in losses.values()}) > 1:
        print(f"WARNING: the rows ended on different losses: {losses}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": spec.as_dict(), "num_params": num_params, "env": args.env,
                       "zero": args.zero_fields, "loadavg": [load, os.getloadavg()], "plain_torch_rss": plain,
                       "rows": records}, f, indent=1)
    return 1 if any("error" in r for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
