"""The main job: a small GPT trained character-level on Python's own documentation, with zeroray.

    python examples/train_gpt.py                      # 2 workers, ZeRO stage 3, CPU, local Ray
    python examples/train_gpt.py --stage 2 --dtype bf16 --num-workers 3
    RAY_ADDRESS=... python examples/train_gpt.py     # the same on a cluster (see cluster/README.md)
"""
from __future__ import annotations

import argparse
import sys
import time

import gpt  # beside this script: zr.Trainer sends its code to the workers, wherever they run

import zeroray as zr


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split over the workers")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--checkpoint-dir", default=None, help="save a sharded checkpoint here at the end")
    p.add_argument("--metrics", default=None, help="append per-step metrics to this JSONL file")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    t0 = time.perf_counter()
    trainer = zr.Trainer(
        lambda: gpt.GPT(cfg), gpt.gpt_loss,
        optimizer=zr.AdamW(lr=args.lr, weight_decay=0.0),
        zero=zr.ZeroConfig(stage=args.stage, dtype=args.dtype, grad_accum_steps=args.grad_accum,
                           max_grad_norm=args.max_grad_norm,
                           activation_checkpointing=(gpt.Block,) if args.activation_checkpointing else False),
        scaling=zr.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                 placement_strategy=args.placement_strategy),
        seed=args.seed, metrics_path=args.metrics)
    for w in trainer.workers:
        print(f"worker {w['rank']} on node {w['node_id']} ({w['ip']})", flush=True)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, ZeRO stage {args.stage}, {args.dtype}, "
          f"{args.num_workers} workers, global batch {args.batch_size} x {args.seq_len}", flush=True)
    data = gpt.CharBatches(args.batch_size, args.seq_len, args.steps, seed=args.seed)
    t_fit = time.perf_counter()
    results = trainer.fit(data, num_steps=args.steps)
    fit_s = time.perf_counter() - t_fit
    first, last = results[0].loss, sum(r.loss for r in results[-10:]) / min(10, len(results))
    print(f"first loss {first:.4f}, last loss (mean of last 10 steps) {last:.4f}")
    print(f"wall time {time.perf_counter() - t0:.1f}s (training {fit_s:.1f}s, "
          f"{fit_s / len(results):.3f}s/step)")
    for rep in trainer.memory_report():
        m, e = rep["measured"], rep["estimate"]
        print(f"worker {rep['rank']}: model state {m['total'] / 2**20:.2f} MiB (params {m['params'] / 2**20:.2f}, "
              f"grads {m['grads'] / 2**20:.2f}, optimizer {m['optimizer'] / 2**20:.2f}); "
              f"estimate {e['total'] / 2**20:.2f} MiB; peak RSS {rep['peak_rss_bytes'] / 2**20:.0f} MiB")
    if args.checkpoint_dir:
        print(f"checkpoint: {trainer.save(args.checkpoint_dir)}")
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
