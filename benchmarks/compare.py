"""zeroray side by side with the compute floor, torch DDP, torch FSDP2 and DeepSpeed.

    python benchmarks/compare.py [--large] [--model gpt|mha|hf-gpt2] [--steps N] [--rounds R] [--workers 2]
        [--only floor,ddp,fsdp2,zr0,zr1,zr2,zr3,ds1,ds2,ds3 (+ eng0-eng3)] [--json out.json] [--zr-prefetch on|off]
        [--zr-buckets fixed,timeout,auto] [--zr-bucket-timeout-ms T] [--zr-bucket-timeout-ms-auto T]
        [--zr-interleave] [--interleave [--turn-steps K]]

Every row trains the same model (``--model``: examples/gpt.py's GPT, or one zeroray did not
write, see bench_models.py) from the same initial weights on the same
real-text global batches, one row after another (never two at once), with one thread per
worker. It prints median s/step, the ratio to the floor, peak RSS per worker and bytes
communicated per worker per step, checks that the multi-worker rows agree on the loss, and
writes everything to JSON. See benchmarks/README.md for what each column means.

This machine's speed drifts by 10-20% over minutes, which moves a row run at another
time more than the differences being measured. ``--rounds R`` runs the whole sequence of
rows R times; each row's median is over its timed steps of every round, and the ratios
the targets are stated in (issue 30: zr0-zr2 against DDP and DeepSpeed 1/2, zr3 against FSDP2
and ds3) are printed per round as well.

``--zr-buckets`` runs each zeroray row in up to three gradient-bucket settings, one after
another: ``fixed`` (the row itself, e.g. zr3: 16 MiB buckets launched when full), ``timeout``
(zr3-timeout: the same with ``bucket_timeout_ms``) and ``auto`` (zr3-auto: ``bucket_bytes="auto"``,
by default with its own timeout). With it, every zeroray row reads comm_report() after each step, and
the table's note gives the median exposed communication over the timed steps and the
buckets of the last step; the size "auto" settled on, and after which step, follow the table.
``--zr-interleave`` builds every zeroray row's trainer at once and steps them in turn, so
that rows compared with each other see the same load (the rows are otherwise minutes apart).
``--interleave`` does that for every row, the torch and DeepSpeed peers included: all rows
alive at once, one step of each in turn, the order rotating each step ([Note: interleaved
rows] in ``run_side_by_side``); with ``--rounds R`` each round builds the rows afresh.
``--turn-steps K`` gives each row K steps a turn and times only the K-1 that follow its own
step ([Note: turns of K steps]).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from common import ROOT, BenchSpec, add_import_paths, median  # noqa: E402

ALL_ROWS = ("floor", "ddp", "fsdp2", "zr0", "zr1", "zr2", "zr3", "ds1", "ds2", "ds3")
# --aa: torch DDP a second time, as a row of its own (see [Note: A/A row]).
AA_ROW = "ddp2"
# The canonical order rows run and print in. eng0-eng3 are opt-in (in --only, never by default):
# zeroray's Engine at stage N in plain spawned processes, no Ray (peers.run_engine), each beside its
# zeroray row; zrN/engN is what Ray adds to a step ([Note: engine rows]). So is apart: the floor in
# every worker at once, no communication ([Note: stage 3's bound]).
ROW_ORDER = ("floor", "apart", "ddp", "fsdp2", "zr0", "eng0", "zr1", "eng1", "zr2", "eng2", "zr3", "eng3",
             "ds1", "ds2", "ds3")
BUCKET_SETTINGS = ("fixed", "timeout", "auto")
DEFAULT_TIMEOUT_MS = 50.0
# Multi-worker rows train on the same global batches and must report the same losses.
LOSS_RTOL = 1e-4
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="d_model 512, 8 layers, 8 heads (default: 256, 4, 4)")
    p.add_argument("--model", choices=("gpt", "mha", "hf-gpt2"), default="gpt",
                   help="gpt: examples/gpt.py; mha: built from nn.MultiheadAttention; hf-gpt2: transformers' "
                        "GPT2LMHeadModel (default gpt)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (median reported; default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, one round after another (default 1)")
    p.add_argument("--workers", type=int, default=2, help="workers for every multi-worker row (default 2)")
    p.add_argument("--only", default=",".join(ALL_ROWS),
                   help="comma-separated rows, in any order; eng0-eng3 (zeroray's engine without Ray) and "
                        "apart (every worker's compute, no communication) only when named here")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "compare.json"),
                   help="where to write the results (default benchmarks/results/compare.json)")
    p.add_argument("--zr-prefetch", choices=("on", "off"), default="on",
                   help="ZeroConfig(prefetch=...) for the zeroray rows (matters for stage 3)")
    p.add_argument("--zr-buckets", default="fixed",
                   help="comma-separated bucket settings for each zeroray row: fixed (zrN), timeout (zrN-timeout), "
                        "auto (zrN-auto); default fixed")
    p.add_argument("--zr-bucket-timeout-ms", type=float, default=DEFAULT_TIMEOUT_MS,
                   help=f"bucket_timeout_ms of the timeout rows (default {DEFAULT_TIMEOUT_MS:g})")
    p.add_argument("--zr-bucket-timeout-ms-auto", type=float, default=None,
                   help="bucket_timeout_ms of the auto rows (default None: derived from the measured backward)")
    p.add_argument("--zr-interleave", action="store_true",
                   help="build every zeroray row's trainer at once and step them in turn (row A's step 1, row B's "
                        "step 1, ...), so the machine's drift slows them alike")
    p.add_argument("--interleave", action="store_true",
                   help="every row, torch and DeepSpeed peers included, alive at once and stepping in turns: "
                        "step i of every row, then step i+1, the order rotating by one row each step (see "
                        "[Note: interleaved rows])")
    p.add_argument("--turn-steps", type=int, default=1,
                   help="with --interleave: each row's turn is this many steps in a row, and the first step of "
                        "every timed turn is left out of the timing (it re-warms what the other rows' turns "
                        "cooled); see [Note: turns of K steps] (default 1: one step a turn, every step timed)")
    p.add_argument("--aa", action="store_true",
                   help=f"add {AA_ROW}: torch DDP again as a row of its own; {AA_ROW}/ddp is the run's resolution "
                        "(see [Note: A/A row])")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a torch/DeepSpeed row is killed")
    # Overrides for quick checks; the defaults are the benchmark.
    p.add_argument("--d-model", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)  # sequences per worker
    p.add_argument("--lr", type=float, default=1e-3, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROW_ORDER]
    if unknown:
        p.error(f"--only: unknown row(s) {unknown}; choose from {','.join(ROW_ORDER)}")
    args.rows = [r for r in ROW_ORDER if r in args.rows]  # always the canonical order
    if args.aa:
        if "ddp" not in args.rows:
            p.error("--aa compares DDP with itself: keep ddp in --only")
        args.rows.insert(args.rows.index("ddp") + 1, AA_ROW)
    buckets = [b.strip() for b in args.zr_buckets.split(",") if b.strip()]
    if not buckets or any(b not in BUCKET_SETTINGS for b in buckets):
        p.error(f"--zr-buckets: choose from {','.join(BUCKET_SETTINGS)}")
    args.bucket_rows = buckets != ["fixed"]
    # zr3 with fixed,timeout,auto -> zr3, zr3-timeout, zr3-auto (one after another)
    args.rows = [variant for r in args.rows for variant in (
        [r + ("" if b == "fixed" else "-" + b) for b in BUCKET_SETTINGS if b in buckets] if r.startswith("zr") else [r])]
    for name in ("steps", "workers", "batch", "threads", "seq_len", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.turn_steps < 1 or (args.turn_steps > 1 and not args.interleave):
        p.error("--turn-steps K: K >= 1, and K > 1 only with --interleave")
    return args


def make_spec(args: argparse.Namespace) -> BenchSpec:
    d_model, layers, heads = (512, 8, 8) if args.large else (256, 4, 4)
    d_model = args.d_model or d_model
    heads = args.heads or (heads if d_model % heads == 0 else 1)
    if d_model % heads:
        raise SystemExit(f"--d-model {d_model} is not divisible by --heads {heads}")
    warmup, timed = args.warmup, args.steps
    k = args.turn_steps
    if k > 1:  # whole turns; each timed turn times k - 1 of its steps ([Note: turns of K steps])
        warmup, timed = -(-warmup // k) * k, -(-timed // (k - 1)) * k
    return BenchSpec(d_model=d_model, n_layers=args.layers or layers, n_heads=heads, seq_len=args.seq_len,
                     batch_per_worker=args.batch, num_workers=args.workers, threads=args.threads,
                     warmup_steps=warmup, timed_steps=timed, lr=args.lr, model=args.model)


# --------------------------------------------------------------------------- rows

def summarise_ranks(ranks: list) -> dict:
    """Fold per-rank results of a torch row into one record (step time: the slowest rank)."""
    n_steps = min(len(r["step_s"]) for r in ranks)
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(n_steps)]
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n_steps)]
    return {
        "step_s": step_s,
        "cpu_s_per_rank": [r.get("cpu_s") for r in ranks],
        "idle_cpu_s_per_rank": [r.get("idle_cpu_s") for r in ranks],
        "opt_s_per_rank": [r.get("opt_s") for r in ranks],
        "losses": losses,
        "rank_losses": [r["losses"] for r in ranks],
        "peak_rss_bytes": [r.get("peak_rss_bytes") for r in ranks],
        "base_rss_bytes": [r.get("base_rss_bytes") for r in ranks],
        "comm": [r["comm"] for r in ranks] if all(r.get("comm") for r in ranks) else None,
    }


def run_peer(row: str, spec: BenchSpec, args) -> dict:
    import peers

    if row == "floor":
        return summarise_ranks(peers.launch("floor", spec, nprocs=1, timeout_s=args.timeout))
    if row in ("apart", "ddp", AA_ROW, "fsdp2"):
        return summarise_ranks(peers.launch(row, spec, nprocs=spec.num_workers, timeout_s=args.timeout))
    kind, stage = peer_kind(row)
    return summarise_ranks(peers.launch(kind, spec, nprocs=spec.num_workers, timeout_s=args.timeout,
                                        extra={"stage": stage}))


def peer_kind(row: str) -> tuple:
    """peers' row kind and the stage a staged peer row runs: ds2 -> ("ds", 2), eng3 -> ("eng", 3)."""
    if row.startswith("ds"):
        return "ds", int(row[2:])
    if row.startswith("eng"):
        return "eng", int(row[3:])
    return row, None


def bucket_config(row: str, args) -> dict:
    """ZeroConfig fields of a zeroray row's bucket setting (zr3: none, zr3-timeout, zr3-auto)."""
    setting = row.partition("-")[2]
    if setting == "timeout":
        return {"bucket_timeout_ms": args.zr_bucket_timeout_ms}
    if setting == "auto":  # without --zr-bucket-timeout-ms: zeroray's own (derived) timeout
        return {"bucket_bytes": "auto", "bucket_timeout_ms": args.zr_bucket_timeout_ms_auto}
    return {}


def run_all(spec: BenchSpec, args) -> dict:
    if args.interleave:
        return run_side_by_side(spec, args)
    records = {}
    zr_rows = [r for r in args.rows if r.startswith("zr")]
    ds_rows = [r for r in args.rows if r.startswith("ds")]
    ds_missing = None
    if ds_rows:
        import peers

        ds_missing = peers.deepspeed_available()
    session, session_error = None, None
    try:
        for row in args.rows:
            if row in ds_rows and ds_missing:
                records[row] = {"status": "skipped", "note": f"deepspeed unavailable ({ds_missing})"}
                continue
            if row in zr_rows and session is None and session_error is None:
                try:
                    from zr_run import ZeroraySession

                    session = ZeroraySession()
                except Exception as e:
                    session_error = f"zeroray unavailable: {type(e).__name__}: {e}"
                    traceback.print_exc()
            if row in zr_rows and session_error:
                records[row] = {"status": "failed", "note": session_error}
                continue
            if row in records:
                continue  # run already, interleaved with the other zeroray rows
            together = zr_rows if row in zr_rows and args.zr_interleave else [row]
            log(f"[{','.join(together)}] running ...")
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            try:
                if row in zr_rows:
                    got = session.run_interleaved(
                        {r: (int(r[2]), bucket_config(r, args)) for r in together}, spec,
                        prefetch=args.zr_prefetch == "on", comm_every_step=args.bucket_rows)
                else:
                    got = {row: run_peer(row, spec, args)}
                for rec in got.values():
                    rec["status"] = "ok"
            except Exception as e:
                traceback.print_exc()
                got = {r: {"status": "failed", "error": str(e),
                           "note": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"} for r in together}
            for name, rec in got.items():
                rec["wall_s"] = time.perf_counter() - t0
                rec["loadavg_1m"] = [load_before, os.getloadavg()[0]]  # before, after: how noisy it was
                records[name] = rec
                if rec["status"] == "ok":
                    log(f"[{name}] median {median(rec['step_s'][spec.warmup_steps:]):.3f} s/step, "
                        f"losses {fmt_losses(rec['losses'])} ({rec['wall_s']:.0f}s, load {load_before:.1f})")
                else:
                    log(f"[{name}] FAILED: {rec['note']}")
            if row in zr_rows and (row == zr_rows[-1] or args.zr_interleave) and session is not None:
                session.close()  # before the DeepSpeed rows: Ray's daemons must not share the cores
                session = None
    finally:
        if session is not None:
            session.close()
    return records


def run_side_by_side(spec: BenchSpec, args) -> dict:
    """One round of ``--interleave``.

    [Note: interleaved rows]
    This machine's speed drifts 10-20% over minutes, so rows run one after another (minutes
    apart) differ by more than what is measured. Here every row is built first (the torch and
    DeepSpeed ranks in their own processes, held at a pipe before each step: peers.GatedRow;
    the zeroray trainers on one Ray), then step i of every row runs, one row at a time, then
    step i+1, with the order rotated by one row each step so that no row always follows the
    same one. A row steps while every other row waits blocked, so it has the cores to itself;
    its neighbours in time are seconds away, not minutes, so drift slows every row alike, and
    the per-step ratios are taken at the same moment. What the rows share: Ray's idle daemons
    stay up through the torch rows' steps too (the zeroray rows need them), which costs the
    peers, not zeroray; peak RSS is still per process.

    [Note: turns of K steps]
    With one step a turn, every timed step follows other rows' steps: it runs on caches, an
    allocator and sockets those rows have cooled, which back-to-back training never does, and a
    row that suffers more from that reads slower than it trains. ``--turn-steps K`` gives each
    row K steps a turn and leaves the first of every timed turn out of the timing, so each timed
    step follows the row's own step, as in training, while turns stay seconds apart and drift
    still slows every row alike. compare.py prints each row's turn-opening against its timed
    median (``opener_lines``): what following the other rows cost that row. Each rank also
    records the CPU its threads used while held (``idle_cpu_s``; for a zeroray row, its worker
    processes' between steps): work a row leaves running past the end of its step would show
    there, and would be done in the other rows' turns.
    """
    import peers
    from common import global_batches

    records: dict = {}
    rows = list(args.rows)
    ds_rows = [r for r in rows if r.startswith("ds")]
    if ds_rows:
        missing = peers.deepspeed_available()
        if missing:
            for r in ds_rows:
                records[r] = {"status": "skipped", "note": f"deepspeed unavailable ({missing})"}
            rows = [r for r in rows if r not in ds_rows]
    zr_rows = [r for r in rows if r.startswith("zr")]
    live: dict = {}
    session = None
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        if zr_rows:
            from zr_run import ZeroraySession

            session = ZeroraySession()
            live.update(session.open_runs({r: (int(r[2]), bucket_config(r, args)) for r in zr_rows}, spec,
                                          prefetch=args.zr_prefetch == "on", comm_every_step=args.bucket_rows))
        for row in rows:
            if row in zr_rows:
                continue
            nprocs = 1 if row == "floor" else spec.num_workers
            kind, stage = peer_kind(row)
            live[row] = peers.GatedRow(kind, spec, nprocs=nprocs, timeout_s=args.timeout,
                                       extra=None if stage is None else {"stage": stage})
        k = args.turn_steps
        log(f"[{','.join(rows)}] built side by side; stepping in turns of {k} step(s) ...")
        batches = list(global_batches(spec))
        for turn, first in enumerate(range(0, len(batches), k)):
            order = rows[turn % len(rows):] + rows[:turn % len(rows)]
            for row in order:
                for batch in batches[first:first + k]:
                    if row not in live:
                        break  # failed earlier
                    try:
                        live[row].step(batch) if row in zr_rows else live[row].step()
                    except Exception as e:
                        traceback.print_exc()
                        records[row] = {"status": "failed", "error": str(e),
                                        "note": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                        live.pop(row).close()
        for row in rows:
            if row not in live:
                continue
            rec = live[row].record() if row in zr_rows else summarise_ranks(live[row].finish())
            if k > 1:
                rec = drop_turn_openers(rec, spec.warmup_steps, k)
            rec.update(status="ok", wall_s=time.perf_counter() - t0, loadavg_1m=[load_before, os.getloadavg()[0]])
            records[row] = rec
            log(f"[{row}] median {median(rec['step_s'][spec.warmup_steps:]):.3f} s/step, "
                f"losses {fmt_losses(rec['losses'])}")
    finally:
        for run in live.values():
            run.close()
        if session is not None:
            session.close()
    return {r: records[r] for r in args.rows if r in records}


def opens_turn(i: int, warmup: int, k: int) -> bool:
    """Whether step ``i`` is the first of a timed turn of ``k`` steps (warmup is whole turns)."""
    return i >= warmup and (i - warmup) % k == 0


def drop_turn_openers(rec: dict, warmup: int, k: int) -> dict:
    """``rec`` with the first step of every timed turn of ``k`` steps left out of its per-step
    lists (the full list stays as ``step_s_all``); warmup is whole turns ([Note: turns of K steps])."""
    def kept(steps):
        return None if steps is None else [s for i, s in enumerate(steps) if not opens_turn(i, warmup, k)]

    out = dict(rec, step_s_all=rec["step_s"], turn_steps=k, step_s=kept(rec["step_s"]))
    if rec.get("comm_steps"):
        out["comm_steps"] = kept(rec["comm_steps"])
    for key in ("cpu_s_per_rank", "opt_s_per_rank"):
        if rec.get(key):
            out[key] = [kept(c) for c in rec[key]]
    return out


# --------------------------------------------------------------------------- derived numbers

# Issue 30's targets, as (row, peer, at most): every zeroray stage at or under the peers that
# move the same bytes (stages 0-2: DDP and DeepSpeed 1/2), stage 3 at 0.85x FSDP2 and under ds3.
TARGETS = (("zr0", "ddp", 1.0), ("zr1", "ddp", 1.0), ("zr1", "ds1", 1.0), ("zr2", "ddp", 1.0), ("zr2", "ds2", 1.0),
           ("zr3", "fsdp2", 0.85), ("zr3", "ds3", 1.0))


def merge_rounds(rounds: list, spec: BenchSpec) -> dict:
    """One record per row: round 1's record, with every round's timed steps pooled."""
    records = {}
    for row, first in rounds[0].items():
        rec = dict(first)
        ok = [r[row] for r in rounds if r.get(row, {}).get("status") == "ok"]
        if ok and len(rounds) > 1:
            rec = dict(ok[0])
            rec["step_s"] = ok[0]["step_s"][:spec.warmup_steps] + [
                t for r in ok for t in r["step_s"][spec.warmup_steps:]]
            rec["round_medians"] = [median(r["step_s"][spec.warmup_steps:]) for r in ok]
            rec["comm"], rec["memory_report"] = ok[-1].get("comm"), ok[-1].get("memory_report")
            if all(r.get("comm_steps") for r in ok):
                rec["comm_steps"] = ok[0]["comm_steps"][:spec.warmup_steps] + [
                    c for r in ok for c in r["comm_steps"][spec.warmup_steps:]]
                rec["round_bucket_changes"] = [_last_report_key(r, "bucket_size_changes") for r in ok]
        records[row] = rec
    return records


# [Note: A/A row]
# With --aa, torch DDP runs twice in the same run, as two rows of their own (ddp, ddp2), built,
# stepped and measured like every other row. They run the same code on the same batches, so
# ddp2/ddp would be 1 on a steady machine; how far it lands from 1, pooled and per round, is how
# finely the run can rank two rows at all. A target ratio closer to its limit than that is
# decided by the machine's noise, not by the rows.
RESOLUTION = ((AA_ROW, "ddp", None),)

# [Note: engine rows]
# An engN row runs the very engine a zrN row's Ray actors run (the same Engine, loss, optimizer
# and gloo group) in plain spawned processes that each slice their own batch, as the torch peers
# do. Stepped in the same interleaved run, zrN/engN is what running on Ray costs a step (the
# driver's call and its reply, the batch's trip, the actor's own threads), and engN/ddp or
# engN/fsdp2 is the engine's own distance from the peer.
DISPATCH = tuple((f"zr{n}", f"eng{n}", None) for n in range(4)) + tuple(
    (f"eng{n}", "ddp" if n < 3 else "fsdp2", None) for n in range(4))

# [Note: stage 3's bound]
# What a stage-3 step could be at the least is its workers' compute with no communication at
# all: the apart row (every worker's forward, backward and optimizer step, at the same moments
# on the same cores: on a machine the workers fill, slower than the floor alone), less the part
# of the optimizer step that sharding removes, (W - 1) / W of it. ``bound / fsdp2`` estimates
# the least zr3/fsdp2 any stage 3 could read in that run, before its own bytes, copies and
# waits. An estimate, not a proof: apart's ranks do not wait for each other, its step is the
# slower rank's, and DDP has stepped a little faster than apart in some runs. Where FSDP2 runs
# close to the floor (the --large models), the 0.85x target sits near it.
def bound_lines(rounds: list, records: dict, spec: BenchSpec) -> tuple:
    """({'bound/fsdp2': {pooled, per_round}}, [line]) when the run has apart and fsdp2."""
    def bound(recs):  # apart's timed steps, less the share of its slowest rank's optimizer time
        w = spec.warmup_steps
        steps = [t for rec in recs for t in rec["step_s"][w:]]
        opt = [max(ranks) for rec in recs for ranks in list(zip(*rec["opt_s_per_rank"]))[w:]]
        return median(steps) - median(opt) * (spec.num_workers - 1) / spec.num_workers

    ok = [r for r in rounds if all(r.get(k, {}).get("status") == "ok" for k in ("apart", "fsdp2"))]
    if not ok or not all(r["apart"].get("opt_s_per_rank") and all(r["apart"]["opt_s_per_rank"]) for r in ok):
        return {}, []
    per_round = [bound([r["apart"]]) / median(r["fsdp2"]["step_s"][spec.warmup_steps:]) for r in ok]
    pooled = bound([r["apart"] for r in ok]) / records["fsdp2"]["step_s_median"]
    rounds_text = f" (rounds: {', '.join(f'{x:.3f}' for x in per_round)})" if len(per_round) > 1 else ""
    return ({"bound/fsdp2": {"pooled": pooled, "per_round": per_round, "target": None}},
            [f"bound/fsdp2 = {pooled:.3f}{rounds_text}: about the least zr3/fsdp2 could be, apart less "
             f"{spec.num_workers - 1}/{spec.num_workers} of its optimizer step ([Note: stage 3's bound])"])


def target_ratios(rounds: list, records: dict, spec: BenchSpec) -> dict:
    """Each target ratio over the pooled steps and per round, with whether it is met; with
    --aa, first the run's resolution (ddp2/ddp, [Note: A/A row])."""
    values, lines = bound_lines(rounds, records, spec)
    for row, peer, limit in RESOLUTION + DISPATCH + TARGETS:
        if records.get(row, {}).get("status") != "ok" or records.get(peer, {}).get("status") != "ok":
            continue
        pooled = records[row]["step_s_median"] / records[peer]["step_s_median"]
        per_round = [median(r[row]["step_s"][spec.warmup_steps:]) / median(r[peer]["step_s"][spec.warmup_steps:])
                     for r in rounds if r.get(row, {}).get("status") == "ok" and r.get(peer, {}).get("status") == "ok"]
        values[f"{row}/{peer}"] = {"pooled": pooled, "per_round": per_round, "target": limit}
        rounds_text = f" (rounds: {', '.join(f'{x:.3f}' for x in per_round)})" if len(per_round) > 1 else ""
        if limit is None:
            what = ("the same DDP twice, this run's resolution" if row == AA_ROW else
                    "what Ray adds to the engine's step" if row.startswith("zr") else "the engine without Ray")
            lines.append(f"{row}/{peer} = {pooled:.3f}{rounds_text}: {what}")
            continue
        lines.append(f"{row}/{peer} = {pooled:.3f}{rounds_text}, target <= {limit:.2f}: "
                     f"{'met' if pooled <= limit else 'NOT met'}")
    return {"values": values, "lines": lines}

def derive(records: dict, spec: BenchSpec) -> None:
    """Add the table's numbers to each ok record: median, x floor, MB per worker."""
    floor = records.get("floor", {})
    floor_s = median(floor["step_s"][spec.warmup_steps:]) if floor.get("status") == "ok" else None
    for rec in records.values():
        if rec.get("status") != "ok":
            continue
        timed = rec["step_s"][spec.warmup_steps:]
        rec["step_s_median"] = median(timed)
        rec["step_s_mean"] = sum(timed) / len(timed) if timed else float("nan")
        rec["x_floor"] = rec["step_s_median"] / floor_s if floor_s else None
        cpu = [c[spec.warmup_steps:] for c in rec.get("cpu_s_per_rank") or [] if c]
        if cpu:  # a contention-free view for the torch rows: CPU seconds of the busiest rank
            rec["cpu_s_median"] = max(median(c) for c in cpu)
            rec["note"] = f"cpu {rec['cpu_s_median']:.3f} s/step"
        rss = [x for x in (rec.get("peak_rss_bytes") or []) if x is not None]
        rec["peak_rss_mb_per_worker"] = [x / MB for x in rss] or None
        comm = rec.get("comm") or []
        total = [c.get("total_bytes") if isinstance(c, dict) else None for c in comm]
        rec["comm_mb_per_worker_step"] = ([float(t) / MB for t in total]
                                          if comm and all(t is not None for t in total) else None)
        extras = []
        for key in ("exposed_s", "comm_s", "prefetch_hits"):
            vals = [c.get(key) for c in comm if isinstance(c, dict) and c.get(key) is not None]
            if vals:
                extras.append(f"{key}={max(vals):.3g}" if key != "prefetch_hits" else f"{key}={int(min(vals))}")
        steps = rec.get("comm_steps")
        if steps:  # the median over timed steps of the busiest worker's exposed communication
            exposed = [max(c.get("exposed_s", 0.0) for c in step if isinstance(c, dict))
                       for step in steps[spec.warmup_steps:] if step]
            rec["exposed_s_median"] = median(exposed)
            blocked = [max(c.get("bucket_blocked_ms", 0.0) for c in step if isinstance(c, dict))
                       for step in steps[spec.warmup_steps:] if step]
            rec["bucket_blocked_ms_median"] = median(blocked)
            extras = [f"exposed_med={rec['exposed_s_median']:.3g} blocked_med={rec['bucket_blocked_ms_median']:.3g}ms"] + [
                e for e in extras if not e.startswith("exposed_s=")]
        last = comm[0] if comm and isinstance(comm[0], dict) else {}
        if "buckets_full" in last:
            extras.append(f"buckets full/timeout/end={last['buckets_full']}/{last['buckets_timeout']}/"
                          f"{last['buckets_end']} wait={last['bucket_first_wait_ms']:.3g}ms "
                          f"size={last['bucket_bytes'] / 2**20:g}MiB"
                          + (f" T={last['bucket_timeout_ms']:.3g}ms" if last.get("bucket_timeout_ms") else ""))
        for report in (comm, rec.get("memory_report") or []):
            extras += [r["error"] for r in report if isinstance(r, dict) and "error" in r][:1]
        if extras:
            rec["note"] = " ".join(extras)
    if floor_s is not None:
        floor["comm_mb_per_worker_step"] = [0.0]


def _last_report_key(rec: dict, key: str):
    comm = rec.get("comm") or []
    return comm[0].get(key) if comm and isinstance(comm[0], dict) else None


def opener_lines(rounds: list, spec: BenchSpec) -> list:
    """With --turn-steps K > 1: each row's turn-opening steps (not timed) against its timed
    ones, pooled over the rounds; how much a step right after other rows' turns costs each row
    ([Note: turns of K steps]). Empty for K = 1."""
    lines = []
    for row in rounds[0]:
        ok = [r[row] for r in rounds if r.get(row, {}).get("status") == "ok" and r[row].get("turn_steps", 1) > 1]
        if not ok:
            continue
        k, w = ok[0]["turn_steps"], spec.warmup_steps
        openers = [t for rec in ok for i, t in enumerate(rec["step_s_all"]) if opens_turn(i, w, k)]
        timed = [t for rec in ok for t in rec["step_s"][w:]]
        lines.append(f"{row}: turn-opening step {median(openers):.3f} s, timed {median(timed):.3f} s, "
                     f"opening/timed = {median(openers) / median(timed):.3f}")
    return lines


def bucket_lines(records: dict) -> list:
    """Where bucket_bytes="auto" settled: the size, the changes, after which step the last one."""
    lines = []
    for name, rec in records.items():
        if rec.get("status") != "ok" or not name.endswith("-auto"):
            continue
        per_round = rec.get("round_bucket_changes") or [_last_report_key(rec, "bucket_size_changes")]
        for i, changes in enumerate(per_round):
            if changes is None:
                continue
            size = (changes[-1][2] if changes else 16 * 2**20) / 2**20
            moves = ", ".join(f"after step {s}: {a / 2**20:g} -> {b / 2**20:g} MiB" for s, a, b in changes)
            where = f" (round {i + 1})" if len(per_round) > 1 else ""
            lines.append(f"{name}{where}: settled on {size:g} MiB" + (
                f" after step {changes[-1][0]} ({len(changes)} change(s): {moves})" if changes else " (no change)"))
    return lines


def check_losses(records: dict, spec: BenchSpec) -> list:
    """Warnings: a row whose loss does not fall; multi-worker rows that disagree on the loss."""
    warnings = []
    ok = {k: r for k, r in records.items() if r.get("status") == "ok" and r.get("losses")}
    for name, rec in ok.items():
        losses = rec["losses"]
        if len(losses) >= 2 and not losses[-1] < losses[0]:
            warnings.append(f"{name}: loss did not decrease ({losses[0]:.4f} -> {losses[-1]:.4f})")
        if not all(math.isfinite(x) for x in losses):
            warnings.append(f"{name}: non-finite loss {fmt_losses(losses)}")
    multi = [k for k in ok if k not in ("floor", "apart")]  # apart's workers train copies of their own
    if multi:
        ref = "ddp" if "ddp" in multi else multi[0]
        for name in multi:
            if name == ref:
                continue
            a, b = ok[ref]["losses"], ok[name]["losses"]
            n = min(len(a), len(b))
            worst = max((abs(a[i] - b[i]) / max(1.0, abs(a[i])) for i in range(n)), default=0.0)
            ok[name]["loss_rel_diff_vs_" + ref] = worst
            if worst > LOSS_RTOL:
                warnings.append(f"{name}: loss differs from {ref} by {worst:.2e} (relative, > {LOSS_RTOL:g}) "
                                f"on the same global batches: {fmt_losses(b[:n])} vs {fmt_losses(a[:n])}")
    # The floor and DDP's rank 0 see the same weights and the same slice at step 0.
    if "floor" in ok and "ddp" in ok and ok["ddp"].get("rank_losses"):
        f0, d0 = ok["floor"]["losses"][0], ok["ddp"]["rank_losses"][0][0]
        if abs(f0 - d0) > LOSS_RTOL * max(1.0, abs(f0)):
            warnings.append(f"floor: step-0 loss {f0:.6f} != DDP rank 0's {d0:.6f} (same weights and slice)")
    return warnings


# --------------------------------------------------------------------------- output

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_losses(losses: list) -> str:
    shown = [f"{x:.4f}" for x in losses] if len(losses) <= 4 else [
        *(f"{x:.4f}" for x in losses[:2]), "...", f"{losses[-1]:.4f}"]
    return "[" + ", ".join(shown) + "]"


def fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(records: dict) -> str:
    header = ("row", "s/step", "x floor", "peak RSS MB/worker", "MB comm/worker/step", "note")
    lines = []
    for name, rec in records.items():
        if rec.get("status") == "skipped":
            continue
        if rec.get("status") != "ok":
            lines.append((name, "-", "-", "-", "-", "FAILED: " + rec.get("note", "")[:70]))
            continue
        rss = rec.get("peak_rss_mb_per_worker")
        comm = rec.get("comm_mb_per_worker_step")
        lines.append((name, fmt(rec["step_s_median"], ".3f"), fmt(rec.get("x_floor"), ".2f"),
                      fmt(max(rss), ".0f") if rss else "-", fmt(max(comm), ".2f") if comm else "-",
                      rec.get("note", "")))
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(out)


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()}
    for name in ("ray", "zeroray", "deepspeed"):
        module = sys.modules.get(name)
        env[name] = getattr(module, "__version__", "?") if module else None
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = make_spec(args)
    add_import_paths()
    # Every process this script starts (the spawned ranks, embedded Ray) inherits one thread.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(spec.threads)
    from common import limit_threads, num_params

    limit_threads(spec.threads)  # the zeroray driver splits batches here; it must not spin up threads

    env = environment()
    log(f"{spec.model} d_model={spec.d_model} layers={spec.n_layers} heads={spec.n_heads} seq={spec.seq_len} "
        f"({num_params(spec) / 1e6:.2f}M params), {spec.num_workers} workers x "
        f"{spec.batch_per_worker} seqs, {spec.threads} thread/worker, {spec.warmup_steps} warmup + "
        f"{spec.timed_steps} timed steps; load average {env['loadavg_start'][0]:.2f} on {env['cpu_count']} cores")

    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            log(f"--- round {r + 1} of {args.rounds}")
        rounds.append(run_all(spec, args))
    records = merge_rounds(rounds, spec)
    derive(records, spec)
    warnings = check_losses(records, spec)
    env = {**environment(), "loadavg_start": env["loadavg_start"], "loadavg_end": os.getloadavg()}

    print(table(records))
    ratios = target_ratios(rounds, records, spec)
    for line in ratios["lines"]:
        print(line)
    for line in opener_lines(rounds, spec) + bucket_lines(records):
        print(line)
    skipped = [f"{k}: {r['note']}" for k, r in records.items() if r.get("status") == "skipped"]
    ds_skipped = [k for k, r in records.items() if r.get("status") == "skipped" and k.startswith("ds")]
    if ds_skipped:
        print(f"note: {','.join(ds_skipped)} skipped, {records[ds_skipped[0]]['note']}")
    for w in warnings:
        print(f"WARNING: {w}")

    out = {
        "spec": spec.as_dict(),
        "num_params": num_params(spec),
        "zr_prefetch": args.zr_prefetch,
        "zr_buckets": args.zr_buckets,
        "zr_bucket_timeout_ms": args.zr_bucket_timeout_ms,
        "zr_bucket_timeout_ms_auto": args.zr_bucket_timeout_ms_auto,
        "zr_interleave": args.zr_interleave,
        "interleave": args.interleave,
        "turn_steps": args.turn_steps,
        "environment": env,
        "rows": records,
        "rounds": args.rounds,
        "target_ratios": ratios["values"],
        "skipped": skipped,
        "warnings": warnings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    log(f"wrote {path}")
    failed = [k for k, r in records.items() if r.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
