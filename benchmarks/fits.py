"""The largest model that fits: the paper's "model size per device", side by side.

    python benchmarks/fits.py [--cap-mb 1000] [--workers 2,4] [--only ddp,fsdp2,zr1,zr2,zr3]
        [--d-model 512 --heads 8 --seq-len 64 --batch 2] [--steps 3] [--max-layers 160] [--json out.json]
        [--offload disk [--offload-only]] [--dtype bf16]

For each row (torch DDP, torch FSDP2, zeroray stages 1-3; ``zr0`` on request) and each worker
count, the deepest GPT (examples/gpt.py, fixed width, layers searched) whose every worker stays
under a per-worker memory cap while it is built and trains ``--steps`` steps on real text. It
prints the table (layers, parameters, the peak of the largest model that fits and of the next
one up) and each row's ratio to DDP's model size. With ``--offload disk`` every zeroray row gets a
twin ``zr<N>+disk`` beside it, the same with ``ZeroConfig(offload="disk")`` (the optimizer state in
files under the system's temporary directory, [Note: disk offload] in zeroray/offload/stepper.py),
under the same cap: the files' pages are the kernel's page cache, not the worker's resident set.
``--dtype bf16`` (or fp16) trains the zeroray rows in mixed precision (the torch rows stay fp32,
so it takes ``--only`` zeroray rows): there the fp32 master is a copy of its own, which
offload="disk" puts in the files too ([Note: master on disk] in zeroray/offload/master.py).

The cap: a worker's peak resident set, the kernel's high-water mark of the process's resident
pages (VmHWM; ``getrusage`` reports it), construction included, must stay at or under
``--cap-mb``. It is what a memory cgroup limit without swap (or a machine's RAM) charges a
process for its anonymous memory, measured by the same kernel counter in every row's own
processes: torch's spawned rank processes, zeroray's Ray worker actors (whose baseline carries
Ray's own ~55 MB more than a plain torch process: charged to zeroray). A model fits or it does
not by that number, so no run is killed and the search is deterministic. Not RLIMIT_AS: that
caps virtual address space, which Ray workers and glibc's per-thread arenas reserve by the
gigabyte without touching it, so it would measure mappings rather than memory and treat the
rows unequally. Not Ray's ``memory`` resource: it is a scheduling hint, and Ray's OOM killer
acts on the node's total, not on a worker.

The search: the peak grows with the layer count, about linearly, so two small models calibrate
a line, the line's answer is tried, and then the bracket between the largest model known to fit
and the smallest known not to is closed by interpolation (usually 3-5 runs per row). The
defaults (d_model 512, 64 tokens x 2 sequences per worker, a 1000 MB cap) keep activations small
beside the model states, the regime the paper's table describes, and one row's runs short.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from common import BenchSpec, add_import_paths  # noqa: E402

ROWS = ("ddp", "fsdp2", "zr0", "zr1", "zr2", "zr3")
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-mb", type=float, default=1000.0, help="peak RSS allowed per worker (MB = 1e6 bytes)")
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    p.add_argument("--only", default="ddp,fsdp2,zr1,zr2,zr3", help="rows, of " + ",".join(ROWS))
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per worker")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-layers", type=int, default=160)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a torch run is killed")
    p.add_argument("--json", default=None)
    p.add_argument("--offload", choices=("disk",), default=None,
                   help="add a zr<N>+disk row beside each zeroray row (ZeroConfig(offload='disk'))")
    p.add_argument("--offload-only", action="store_true",
                   help="with --offload: the zr<N>+disk rows only (a change to the disk tier leaves the in-memory "
                        "rows as they were)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the zeroray rows' ZeroConfig.dtype (mixed precision: the torch rows are refused)")
    args = p.parse_args(argv)
    args.rows = [r for r in ROWS if r in {x.strip() for x in args.only.split(",")}]
    if args.dtype != "fp32" and any(not r.startswith("zr") for r in args.rows):
        p.error(f"--dtype {args.dtype} applies to the zeroray rows only (the torch rows train in fp32): "
                "pass --only with zr rows, e.g. --only zr1,zr3")
    if args.offload:
        args.rows = [x for r in args.rows for x in ((r, f"{r}+{args.offload}") if r.startswith("zr") else (r,))]
        if args.offload_only:
            args.rows = [r for r in args.rows if "+" in r]
    elif args.offload_only:
        p.error("--offload-only needs --offload disk")
    args.worker_counts = [int(w) for w in args.workers.split(",")]
    return args


def spec_for(args, layers: int, workers: int) -> BenchSpec:
    return BenchSpec(d_model=args.d_model, n_layers=layers, n_heads=args.heads, seq_len=args.seq_len,
                     batch_per_worker=args.batch, num_workers=workers, threads=1, warmup_steps=0,
                     timed_steps=args.steps)


class Runner:
    """Peak RSS of the largest worker of one row at one size (cached); torch rows in spawned
    processes, zeroray rows in one embedded Ray shared by all of them."""

    def __init__(self, args) -> None:
        self.args = args
        self.session = None
        self.runs = 0

    def peak(self, row: str, layers: int, workers: int) -> int:
        spec = spec_for(self.args, layers, workers)
        self.runs += 1
        if row.startswith("zr"):
            if self.session is None:
                from memory_rss import ZerorayRows

                self.session = ZerorayRows({})
            stage, _, offload = row[2:].partition("+")
            fields = {"offload": offload} if offload else {}
            if self.args.dtype != "fp32":
                fields["dtype"] = self.args.dtype
            workers_rss = self.session.run(int(stage), spec, fields)["workers"]
            return max(int(w["peak_rss"]) for w in workers_rss)
        import peers

        ranks = peers.launch(row, spec, nprocs=workers, timeout_s=self.args.timeout)
        return max(int(r["peak_rss_bytes"]) for r in ranks)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def largest_that_fits(peak: Callable[[int], int], cap: float, max_layers: int,
                      log: Callable[[str], None]) -> Tuple[int, Dict[int, int]]:
    """The largest layer count whose peak is <= cap (0 if none), and every peak measured."""
    seen: Dict[int, int] = {}

    def probe(layers: int) -> int:
        if layers not in seen:
            seen[layers] = peak(layers)
            log(f"    {layers} layers: peak {seen[layers] / MB:.0f} MB ({'fits' if seen[layers] <= cap else 'over'})")
        return seen[layers]

    def bracket() -> Tuple[int, Optional[int]]:
        fit = max((n for n, p in seen.items() if p <= cap), default=0)
        over = min((n for n, p in seen.items() if p > cap and n > fit), default=None)
        return fit, over

    for layers in (2, 6):
        probe(min(layers, max_layers))
    while True:
        fit, over = bracket()
        if over is not None and over - fit <= 1:
            return fit, seen
        if fit >= max_layers:
            return max_layers, seen
        # The line through the two measured points nearest the cap, solved for the cap; once the
        # cap is bracketed, through the bracket's ends (a rising line, however noisy the points
        # inside: two neighbours whose peaks came out in the wrong order made a falling line, and
        # the search then walked down from twice the fit one layer per run).
        points = sorted(seen.items(), key=lambda kv: abs(kv[1] - cap))[:2]
        if over is not None and fit:
            points = [(fit, seen[fit]), (over, seen[over])]
        (n1, p1), (n2, p2) = sorted(points)
        slope = (p2 - p1) / (n2 - n1) if n2 != n1 and p2 != p1 else None
        guess = int(n1 + (cap - p1) / slope) if slope and slope > 0 else fit * 2 or 1
        upper = over - 1 if over is not None else max_layers
        probe(max(fit + 1, min(guess, upper)))


def main(argv=None) -> int:
    args = parse_args(argv)
    add_import_paths()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    from common import limit_threads, num_params

    limit_threads(1)
    cap = args.cap_mb * MB
    load = os.getloadavg()
    print(f"per-worker cap {args.cap_mb:.0f} MB of peak RSS; {args.dtype}; GPT d_model {args.d_model}, "
          f"{args.heads} heads, "
          f"{args.seq_len} tokens x {args.batch} sequences per worker, {args.steps} steps; "
          f"load average {load[0]:.2f}", flush=True)
    runner, results = Runner(args), {}
    t0 = time.perf_counter()
    try:
        for workers in args.worker_counts:
            for row in args.rows:
                log(f"[{row}, {workers} workers]")
                try:
                    layers, seen = largest_that_fits(lambda n: runner.peak(row, n, workers), cap,
                                                     args.max_layers, log)
                    results[(row, workers)] = {"layers": layers, "peaks": seen,
                                               "params": num_params(spec_for(args, layers, workers)) if layers else 0}
                except Exception as e:  # noqa: BLE001 - the row says FAILED, the others still run
                    traceback.print_exc()
                    results[(row, workers)] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        runner.close()
    print(table(results, args))
    print(f"{runner.runs} runs in {time.perf_counter() - t0:.0f} s; load average {load[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {f"{r}@{w}": v for (r, w), v in results.items()}}, f, indent=1)
    return 1 if any("error" in r for r in results.values()) else 0


def table(results: dict, args) -> str:
    header = ("workers", "row", "layers", "params (M)", "x DDP", "peak at it (MB)", "next up (MB)")
    lines = []
    for (row, workers), r in results.items():
        if "error" in r:
            lines.append((str(workers), row, "FAILED: " + r["error"][:60], "", "", "", ""))
            continue
        ddp = results.get(("ddp", workers), {})
        ratio = f"{r['params'] / ddp['params']:.2f}" if ddp.get("params") else "-"
        at = r["peaks"].get(r["layers"])
        nxt = r["peaks"].get(r["layers"] + 1)
        lines.append((str(workers), row, str(r["layers"]), f"{r['params'] / 1e6:.1f}", ratio,
                      f"{at / MB:.0f}" if at else "-", f"{nxt / MB:.0f}" if nxt else "-"))
    widths = [max(len(x[i]) for x in (header, *lines)) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
