"""What an in-memory snapshot after every step costs (``FailureConfig(snapshot_every=1)``):
seconds per step and peak RSS per worker, against the same fit without snapshots.

    PYTHONPATH=$PWD python benchmarks/snapshot_cost.py --large --rounds 2

The main job's GPT (examples/gpt.py; default d_model 256, 4 layers, 4 heads; ``--large``
512, 8, 8 as in compare.py), 2 workers, ZeRO ``--stage`` (default 3), batches of 8 sequences of
128 bytes per worker. Each round runs both settings one after the other on fresh trainers, in
the other order the next round (``--warmup`` steps untimed, then ``--steps`` timed, the wall time of fit itself, which waits
for each snapshot's record), so the machine's load hits both alike; the figure is the median
over rounds. Also printed: the snapshot's bytes per worker (memory_report's snapshot_bytes,
held in the object store, outside the workers), each worker's peak RSS (the kernel's high-water
mark, which counts the object-store pages a worker wrote: shared memory of the node, not the
worker's heap) and rank 0's resident set now, split into heap (RssAnon) and shared (RssShmem).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import ray  # noqa: E402

import gpt  # noqa: E402
import zeroray as zr  # noqa: E402


def one(cfg, stage: int, every, warmup: int, steps: int, workers: int) -> dict:
    batches = list(gpt.CharBatches(batch_size=8 * workers, seq_len=cfg.seq_len, num_steps=warmup + steps, seed=0))
    with zr.Trainer(lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=zr.AdamW(lr=3e-4),
                    zero=zr.ZeroConfig(stage=stage), scaling=zr.ScalingConfig(num_workers=workers),
                    failure=zr.FailureConfig(max_failures=1, snapshot_every=every)) as trainer:
        trainer.fit(batches[:warmup], progress=False)
        t0 = time.perf_counter()
        # fit continues from its data position ([Note: data replay]): given the whole list it
        # skips the warm-up's batches and trains the ``steps`` after them (given batches[warmup:]
        # it skipped ``warmup`` of those too, and trained steps - warmup).
        done = trainer.fit(batches, progress=False)
        assert len(done) == steps, (len(done), steps)
        per_step = (time.perf_counter() - t0) / steps
        report = trainer.memory_report()
        parts = trainer.run(_rss_parts)
    return {"s_per_step": per_step, "peak_rss_mb": [round(r["peak_rss_bytes"] / 1e6) for r in report],
            "snapshot_mb": [round(r["snapshot_bytes"] / 1e6, 1) for r in report], "rank0_rss_now_mb": parts}


def _rss_parts(model) -> dict:
    """Rank 0's resident set now, by kind: its own heap (anon) and the shared memory it mapped,
    which includes the pages of Ray's object store it wrote (the snapshots it returned)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = round(int(value.split()[0]) * 1024 / 1e6)
    return fields


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="d_model 512, 8 layers, 8 heads (default: 256, 4, 4)")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    d_model, layers, heads = (512, 8, 8) if args.large else (256, 4, 4)
    cfg = gpt.GPTConfig(seq_len=128, d_model=d_model, n_layers=layers, n_heads=heads)
    ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    runs = {None: [], 1: []}
    for r in range(args.rounds):
        for every in ((None, 1) if r % 2 == 0 else (1, None)):  # the order alternates: drift hits both alike
            out = one(cfg, args.stage, every, args.warmup, args.steps, args.workers)
            runs[every].append(out)
            print(f"round {r} snapshot_every={every}: {json.dumps(out)}", flush=True)
    base = statistics.median(o["s_per_step"] for o in runs[None])
    snap = statistics.median(o["s_per_step"] for o in runs[1])
    print(f"SNAPSHOT_COST {json.dumps({'large': args.large, 'stage': args.stage, 's_per_step_without': round(base, 3), 's_per_step_with': round(snap, 3), 'cost_pct': round(100 * (snap - base) / base, 1), 'peak_rss_mb_without': runs[None][-1]['peak_rss_mb'], 'peak_rss_mb_with': runs[1][-1]['peak_rss_mb'], 'snapshot_mb_per_worker': runs[1][-1]['snapshot_mb']})}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
