"""Model-state bytes per worker, measured vs the paper's estimate: stages 0-3, 1/2/4 workers, fp32 and bf16.

    python benchmarks/memory_table.py                       # the main job's model (3.26M params)
    python benchmarks/memory_table.py --d-model 512 --layers 8 --json /tmp/memory.json

Every configuration trains one step in plain torch gloo processes (tests/dist/harness.py; one
set of 4 processes serves every world size). Per worker it prints:
- measured: bytes of the storages the engine holds (zeroray.memory.report.measure: parameter
  buffers and shard, fp32 gradient, fp32 master and the optimizer's state tensors);
- estimate: zeroray.memory.model's per-stage formulas on the engine's padded layout with zeroray's
  documented deviations (memory_report.expected_model_state), computed from the configuration
  only;
- paper: the paper's formula as printed (16-bit gradients in mixed precision, full gradients
  at stage 1, no local parameter shard, no padding);
- census: every floating-point tensor storage the worker process gained while building and
  training the engine (a gc walk), minus the bucket pools: what the process really holds for
  model states, found without asking the engine.
MB = 1e6 bytes, as in the paper.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import zeroray as zr  # noqa: E402
from examples import gpt  # noqa: E402
from tests.dist.harness import run_engines  # noqa: E402

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16")


def build_specs(cfg: gpt.GPTConfig, worlds):
    keys, specs = [], []
    for world in sorted(worlds, reverse=True):  # widest first: ranks beyond a spec's world finish early
        batches = list(gpt.CharBatches(world, cfg.seq_len, 1, seed=0))
        for dtype in DTYPES:
            for stage in STAGES:
                keys.append((world, dtype, stage))
                specs.append(dict(model_fn=functools.partial(gpt.GPT, cfg), loss_fn=gpt.gpt_loss,
                                  optimizer=zr.AdamW(lr=1e-3), zero=zr.ZeroConfig(stage=stage, dtype=dtype),
                                  batches=batches, census=True, world=world))
    return keys, specs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--workers", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--json", default=None, help="write every worker's report here")
    args = p.parse_args(argv)
    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    worlds = sorted({int(w) for w in args.workers.split(",")})
    keys, specs = build_specs(cfg, worlds)
    runs = run_engines(max(worlds), specs)
    reports = {key: [r["memory"] for r in results] for key, (results, _) in zip(keys, runs)}

    any_rep = next(iter(reports.values()))[0]
    print(f"GPT d_model {cfg.d_model}, {cfg.n_layers} layers, seq {cfg.seq_len}: {any_rep['num_params']:,} "
          "trainable parameters; AdamW; one step per configuration")
    print("\nModel-state bytes per worker (largest rank), MB = 1e6 B: measured / estimate (difference)\n")
    header = f"{'dtype':5} {'workers':>7} | " + " | ".join(f"{'stage ' + str(s):^26}" for s in STAGES)
    print(header)
    print("-" * len(header))
    worst = 0.0
    for dtype in DTYPES:
        for world in worlds:
            cells = []
            for stage in STAGES:
                rep = max(reports[(world, dtype, stage)], key=lambda r: r["measured"]["total"])
                m, e = rep["measured"]["total"], rep["estimate"]["total"]
                diff = (m - e) / e
                worst = max(worst, abs(diff))
                cells.append(f"{m / 1e6:8.3f} / {e / 1e6:8.3f} ({diff:+.2%})")
            print(f"{dtype:5} {world:>7} | " + " | ".join(cells))
    print(f"\nlargest |measured - estimate| / estimate: {worst:.3%}")

    print("\nBy category, measured (estimate; paper's formula as printed), MB; census = all live float "
          "tensor bytes the worker gained, minus bucket pools\n")
    print(f"{'dtype':5} {'W':>2} {'stage':>5} | {'params':^28} | {'grads':^28} | {'optimizer':^28} | "
          f"{'census':>8} {'buckets':>8}")
    for dtype in DTYPES:
        for world in worlds:
            for stage in STAGES:
                rep = reports[(world, dtype, stage)][0]
                cols = []
                for key in ("params", "grads", "optimizer"):
                    cols.append(f"{rep['measured'][key] / 1e6:7.3f} ({rep['estimate'][key] / 1e6:7.3f}; "
                                f"{rep['paper'][key] / 1e6:7.3f})")
                census = rep["live_tensor_bytes"] - rep["bucket_buffers"]
                print(f"{dtype:5} {world:>2} {stage:>5} | " + " | ".join(cols)
                      + f" | {census / 1e6:8.3f} {rep['bucket_buffers'] / 1e6:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{w}/{d}/{s}": reps for (w, d, s), reps in reports.items()}, f, indent=1)
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
