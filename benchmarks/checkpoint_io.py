"""Save and load throughput of sharded checkpoints next to the disk's write bandwidth (dd).

    python benchmarks/checkpoint_io.py [--d-model 1024 --layers 8] [--workers 2] [--dir /tmp/zr-ckpt-bench]

Builds a GPT of >= 100M parameters under ZeRO stage 3, takes one step (so the optimizer
state exists), saves (every worker writes its shard in parallel), restores at another
worker count, and reports MB/s of checkpoint bytes, next to `dd` writing the same number of
bytes with fdatasync in the same directory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt  # noqa: E402
import ray.cloudpickle  # noqa: E402

import zeroray as zr  # noqa: E402

ray.cloudpickle.register_pickle_by_value(gpt)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def dd_mb_s(directory: str, nbytes: int) -> float:
    target = os.path.join(directory, "dd.bin")
    count = max(1, nbytes // 2**20)
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fdatasync"],
                         capture_output=True, text=True)
    os.remove(target)
    line = out.stderr.strip().splitlines()[-1]  # "... copied, 1.23 s, 456 MB/s"
    seconds = float(line.split(",")[-2].split()[0])
    return count * 2**20 / 1e6 / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--restore-workers", type=int, default=3)
    p.add_argument("--dir", default="/tmp/zr-ckpt-bench")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=8, seq_len=64)
    n_params = sum(q.numel() for q in gpt.GPT(cfg).parameters())
    print(f"model: {n_params / 1e6:.0f}M parameters")
    batch = next(iter(gpt.CharBatches(2 * args.workers * args.restore_workers, 64, 1)))
    trainer = zr.Trainer(lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=zr.AdamW(lr=1e-4),
                         zero=zr.ZeroConfig(stage=3), scaling=zr.ScalingConfig(num_workers=args.workers))
    trainer.step(batch)
    t0 = time.perf_counter()
    path = trainer.save(args.dir)
    save_s = time.perf_counter() - t0
    trainer.shutdown()
    nbytes = dir_bytes(path)
    t0 = time.perf_counter()
    restored = zr.Trainer.restore(args.dir, lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=zr.AdamW(lr=1e-4),
                                  zero=zr.ZeroConfig(stage=3),
                                  scaling=zr.ScalingConfig(num_workers=args.restore_workers))
    total_restore_s = time.perf_counter() - t0
    # Time the load alone (the restore above includes starting the actors).
    t0 = time.perf_counter()
    restored.controller.load(path)
    load_s = time.perf_counter() - t0
    restored.shutdown()
    disk = dd_mb_s(args.dir, nbytes)
    print(f"checkpoint: {nbytes / 1e6:.0f} MB in {len(os.listdir(path))} files")
    print(f"save  ({args.workers} workers in parallel): {save_s:.2f} s = {nbytes / 1e6 / save_s:.0f} MB/s")
    print(f"load  ({args.restore_workers} workers, resharded {args.workers}->{args.restore_workers}): "
          f"{load_s:.2f} s = {nbytes / 1e6 / load_s:.0f} MB/s (restore incl. actor start {total_restore_s:.1f} s)")
    print(f"disk  (dd, fdatasync, same dir): {disk:.0f} MB/s")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
