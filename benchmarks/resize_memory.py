"""Peak RSS of each new worker during an in-place resize, next to a worker that never resized.

A GPT from examples/gpt.py (default d_model 1024, 8 layers: 101M parameters, 1.2 GB of fp32
master weights and Adam state) trains one step at ZeRO stage 3 on ``--from`` workers, then
``trainer.resize(--to)``. Printed per new worker: its peak resident set over its whole life
(``VmHWM`` of the actor process, read from ``/proc``, so the figure means the same for any
version of zeroray), and, as the yardstick, the same for a Trainer started at ``--to`` workers
that took one step (what a worker of that size holds anyway). The difference is what the
resize itself cost a new worker.

    python benchmarks/resize_memory.py                     # 101M params, 2 -> 3 workers
    python benchmarks/resize_memory.py --d-model 256 --layers 2 --from 2 --to 3   # a quick check
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples")]

import gpt  # noqa: E402
import zeroray as zr  # noqa: E402

MB = 1e6


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set) of a process on this machine."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--from", dest="old", type=int, default=2)
    p.add_argument("--to", dest="new", type=int, default=3)
    args = p.parse_args(argv)
    logging.getLogger("zeroray").setLevel(logging.WARNING)
    cfg = gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    rows = args.old * args.new
    batch = next(iter(gpt.CharBatches(rows, args.seq_len, 1, seed=0)))
    params = gpt.num_params(cfg)
    print(f"zeroray from {os.path.dirname(zr.__file__)}; GPT {params / 1e6:.1f}M params, stage 3 fp32 AdamW "
          f"(model state {16 * params / MB:.0f} MB: params, grads, master and Adam), resize "
          f"{args.old} -> {args.new}", flush=True)

    def trainer(num_workers):
        return zr.Trainer(lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=zr.AdamW(lr=1e-3),
                          zero=zr.ZeroConfig(stage=3), scaling=zr.ScalingConfig(num_workers=num_workers))

    with trainer(args.new) as fresh:
        fresh.step(batch)
        yardstick = [peak_rss_bytes(w["pid"]) for w in fresh.workers]
    print("started at %d workers, one step: peak RSS per worker %s MB" % (
        args.new, ", ".join(f"{b / MB:.0f}" for b in yardstick)), flush=True)

    with trainer(args.old) as resized:
        resized.step(batch)
        t0 = time.perf_counter()
        resized.resize(args.new)
        took = time.perf_counter() - t0
        peaks = [peak_rss_bytes(w["pid"]) for w in resized.workers]
        loss = resized.step(batch).loss
    print("resized %d -> %d in %.1f s: peak RSS per new worker %s MB (loss after %.4f)" % (
        args.old, args.new, took, ", ".join(f"{b / MB:.0f}" for b in peaks), loss))
    extra = [(a - b) / MB for a, b in zip(peaks, yardstick)]
    print("the resize's own cost per new worker (peak - yardstick): %s MB; whole model state %.0f MB, "
          "a new worker's share %.0f MB" % (", ".join(f"{e:+.0f}" for e in extra), 16 * params / MB,
                                            16 * params / args.new / MB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
