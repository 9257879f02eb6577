"""The soak: one long fit of the main job's GPT with a snapshot after every step, a warm spare and a
checkpoint every 100 steps, a worker SIGKILLed half way; does anything grow?

    python benchmarks/soak.py                    # 3,000 steps, kill at step 1,500 (the issue's soak)
    python benchmarks/soak.py --steps 300 --every 20 --kill-at 150 --d-model 64 --layers 2 --seq-len 32
    python benchmarks/soak.py --json benchmarks/results/soak_after.json   # default: soak.json there

The model, data and optimizer are examples/train_gpt.py's (its parse_args, optimizer and the
GPT and CharBatches of examples/gpt.py): by default 2 workers, ZeRO stage 3, fp32, global batch
16 x 128, AdamW lr 3e-3. Any of train_gpt.py's flags (``--stage``, ``--num-workers``,
``--d-model``, ...) may follow. ``fit`` runs ``--steps`` steps with
``FailureConfig(max_failures=3, snapshot_every=1, spares=1)`` and
``CheckpointConfig(every_steps=--every, keep=2)`` in a temporary directory (or
``--checkpoint-dir``, which must be empty).

Every ``--every`` steps the driver samples (tests/soak_sampling.py, [Note: sampling inside fit]):
its own and each worker's RSS and heap (RssAnon), their open file descriptors, the object
store's use (plasma bytes, and of them the live primary copies) and the raylet's and GCS
server's heap. As the batch of step ``--kill-at`` is asked for, worker ``--kill-rank`` is
SIGKILLed by its pid: fit replaces it with the spare and resumes from the in-memory snapshot.
The last row is taken after fit returned (its snapshot released).

Printed: the table, and each figure's least-squares slope per 1,000 steps over the samples from
``--warmup`` on (default 300: the processes' heaps reach their working set over the first
steps, and the checkpoint directory its steady two kept at the third save), with the kill's
one-off jump fitted apart (the killed rank's new process leaves out its own first ``--warmup``
steps). The samples, the recoveries and the run's settings go to the JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import gpt  # noqa: E402
import train_gpt  # noqa: E402
import zeroray as zr  # noqa: E402
from tests.soak_sampling import Sampler, SoakData, format_slopes, format_table, slopes  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to examples/train_gpt.py.")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=100, help="sample and checkpoint every N steps (default 100)")
    p.add_argument("--kill-at", type=int, default=1500, help="SIGKILL a worker as this step's batch is asked for")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--warmup", type=int, default=300, help="samples before this step are left out of the slopes")
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "soak.json"))
    p.add_argument("--from", dest="saved", metavar="JSON",
                   help="print the table and slopes of a saved run; run nothing")
    args, rest = p.parse_known_args(argv)
    if args.saved:
        return args, None
    job = train_gpt.parse_args(rest + ["--steps", str(args.steps)])
    if job.resume is not None or job.stop_after is not None:
        p.error("the soak is one fresh fit: --resume and --stop-after do not apply")
    if not 0 < args.kill_at <= args.steps:
        p.error(f"--kill-at {args.kill_at} must be a step of the run (1..{args.steps})")
    return args, job


def build(job, ckpt_dir: str, args) -> zr.Trainer:
    """examples/train_gpt.py's trainer (a fresh run), with the soak's failure and checkpoint settings."""
    cfg = gpt.GPTConfig(seq_len=job.seq_len, d_model=job.d_model, n_layers=job.layers, n_heads=job.heads)
    return zr.Trainer(
        lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=train_gpt.optimizer(job, resuming=False),
        zero=zr.ZeroConfig(stage=job.stage, dtype=job.dtype, grad_accum_steps=job.grad_accum,
                           max_grad_norm=job.max_grad_norm,
                           activation_checkpointing=(gpt.Block,) if job.activation_checkpointing else False),
        scaling=zr.ScalingConfig(num_workers=job.num_workers, use_gpu=job.use_gpu,
                                 placement_strategy=job.placement_strategy),
        failure=zr.FailureConfig(max_failures=args.max_failures, snapshot_every=1, spares=args.spares),
        checkpoint=zr.CheckpointConfig(path=ckpt_dir, every_steps=args.every, keep=job.keep_checkpoints),
        seed=job.seed)


def main(argv=None) -> int:
    args, job = parse_args(argv)
    if args.saved:
        with open(args.saved) as f:
            report(json.load(f))
        return 0
    own_dir = job.checkpoint_dir is None
    ckpt_dir = tempfile.mkdtemp(prefix="zr-soak-") if own_dir else job.checkpoint_dir
    if not own_dir and os.path.exists(ckpt_dir) and os.listdir(ckpt_dir):
        sys.exit(f"--checkpoint-dir {ckpt_dir} is not empty: the soak starts a fresh run")
    started = time.time()
    print(f"soak: {args.steps} steps, sample and checkpoint every {args.every}, SIGKILL of worker "
          f"{args.kill_rank} at step {args.kill_at}; load {_loadavg()}", flush=True)
    trainer = build(job, ckpt_dir, args)
    sampler = Sampler(trainer, on_sample=_progress)
    data = SoakData(gpt.CharBatches(job.batch_size, job.seq_len, args.steps, seed=job.seed), sampler,
                    args.every, kills=[(args.kill_at, args.kill_rank)])
    out = {"args": vars(args), "job": vars(job), "started": started, "fit_s": None}
    results, reports, error = [], [], None
    try:
        n_params = gpt.num_params(gpt.GPTConfig(seq_len=job.seq_len, d_model=job.d_model, n_layers=job.layers,
                                                n_heads=job.heads))
        print(f"model: {n_params / 1e6:.2f}M parameters, stage {job.stage}, {job.dtype}, {job.num_workers} "
              f"workers, global batch {job.batch_size} x {job.seq_len}", flush=True)
        t_fit = time.time()
        results = trainer.fit(data, num_steps=args.steps, progress=False)
        out["fit_s"] = time.time() - t_fit
        sampler.take(trainer.step_count, when="after fit")
        reports = trainer.memory_report()
    except Exception as e:  # noqa: BLE001 - what was sampled up to the error is still worth keeping
        error = f"{type(e).__name__}: {e}"
        print(f"\nthe soak failed at step {trainer.step_count}: {error}", flush=True)
    finally:
        out["recoveries"] = [dict(r) for r in trainer.recoveries]
        trainer.shutdown()
        if own_dir:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    samples = sampler.samples
    snapshot = sum(r["snapshot_bytes"] for r in reports)
    if results:
        fit_s = out["fit_s"]
        print(f"\nfit: {len(results)} steps in {fit_s:.0f} s ({fit_s / len(results):.3f} s/step), loss "
              f"{results[0].loss:.3f} -> {sum(r.loss for r in results[-10:]) / min(10, len(results)):.3f}; "
              f"load at the end {_loadavg()}")
    out.update({"error": error, "steps": len(results), "losses": [r.loss for r in results[::args.every]],
                "killed": data.killed, "snapshot_bytes": snapshot, "samples": samples})
    out["slopes"] = report(out)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nsamples: {args.json}")
    return 1 if error else 0


def report(out: dict) -> dict:
    """Print a run's kill, recoveries, table and slopes (also from a saved JSON: ``--from``); the slopes."""
    args, samples = out["args"], out["samples"]
    killed = out["killed"] if isinstance(out["killed"], list) else [out["killed"]] if out["killed"] else []
    for k in killed:
        print(f"killed: worker {k['rank']} (pid {k['pid']}) as step {k['step']}'s batch was asked for, "
              f"{k['applied']} steps applied")
    for r in out["recoveries"]:
        print(f"recovery: {r.get('mode')} from {r.get('restored_from')} at step {r['step']}, {r['redone_steps']} "
              f"step(s) redone, {float(r['seconds']):.1f} s, spares used {r.get('spares_used')}; {r['cause'][:100]}")
    if out.get("snapshot_bytes"):
        print(f"snapshot: {out['snapshot_bytes'] / 2**20:.1f} MiB over the workers (memory_report's snapshot_bytes)")
    fitted = slopes(samples, args["warmup"], killed)
    print("\n" + format_table(samples, killed))
    print(f"\nslopes: least squares over the samples inside fit from step {args['warmup']} on, each kill's jump "
          "fitted apart (from the first sample after it); heap = RssAnon; store = plasma bytes (live = primary "
          "copies)")
    print(format_slopes(fitted, samples))
    return fitted


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _progress(sample) -> None:
    workers = ", ".join(f"w{w['rank']} {w.get('rss', 0) / 2**20:.0f} MiB/{w.get('fds', '-')} fds (pid {w['pid']})"
                        for w in sample["workers"])
    print(f"step {sample['step']}: load {sample['loadavg'][0]:.1f}; driver {sample['driver']['rss'] / 2**20:.0f} MiB/"
          f"{sample['driver']['fds']} fds; {workers}; store {sample['store']['bytes_used'] / 2**20:.1f} MiB "
          f"({sample['store']['objects']} objects)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
