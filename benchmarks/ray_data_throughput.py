"""Ray Data input next to the same run fed through ``step``: steps/s and tokens/s.

One zr.Trainer (GPT from examples/gpt.py, ZeRO stage 3, 2 workers) trains the same number of
steps on the same global batch size two ways, alternately, each twice:

- ``step``: ``trainer.fit(list_of_global_batches)``; the driver splits every global batch and
  ships the shards to the workers through the object store (``trainer.step``'s path);
- ``ray.data``: ``trainer.fit(dataset, batch_size=GLOBAL)`` on a ``ray.data.Dataset`` of the
  same rows; every worker pulls its own ``streaming_split`` and the driver sends no data.

Per run it prints the wall time of the whole ``fit`` call (the Ray Data one includes starting
its streaming executor) and the steady state: the median wall time between consecutive steps
after the first (from the metrics JSONL), as steps/s and tokens/s (batch x seq_len per step).

    python benchmarks/ray_data_throughput.py                   # d_model 128, 2 layers, seq 64, batch 16
    python benchmarks/ray_data_throughput.py --steps 40 --d-model 256 --layers 4 --seq-len 128
    python benchmarks/ray_data_throughput.py --map             # through a map_batches stage each pass
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402

import gpt  # noqa: E402
import zeroray as zr  # noqa: E402

ray.cloudpickle.register_pickle_by_value(gpt)  # the workers have no examples/ on their path


def as_int64(batch):
    """The --map stage: a little per-block work, in tasks that finish in any order."""
    return {name: column.astype("int64") for name, column in batch.items()}


def dict_loss(model, batch):
    return gpt.gpt_loss(model, (batch["idx"], batch["tgt"]))


def records(metrics_path: str) -> list:
    with open(metrics_path) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--map", action="store_true", help="feed the rows through a map_batches stage each pass "
                                                       "(instead of materialized blocks), as a pipeline that "
                                                       "reads or tokenizes would; its tasks finish out of order")
    args = p.parse_args(argv)

    import ray.data

    logging.getLogger("zeroray").setLevel(logging.WARNING)  # no progress lines; the JSONL has the steps
    cfg = gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    # Both ways feed dicts {"idx", "tgt"}: a Trainer keeps one batch structure.
    batches = [{"idx": x, "tgt": y} for x, y in gpt.CharBatches(args.batch_size, args.seq_len, args.steps, seed=0)]
    rows = [{"idx": b["idx"][i].numpy(), "tgt": b["tgt"][i].numpy()} for b in batches for i in range(args.batch_size)]
    metrics = os.path.join(tempfile.mkdtemp(prefix="zr-raydata-bench-"), "metrics.jsonl")
    trainer = zr.Trainer(lambda: gpt.GPT(cfg), dict_loss, optimizer=zr.AdamW(lr=1e-3),
                         zero=zr.ZeroConfig(stage=args.stage),
                         scaling=zr.ScalingConfig(num_workers=args.num_workers, threads_per_worker=1),
                         metrics_path=metrics)
    dataset = ray.data.from_items(rows, override_num_blocks=8).materialize()  # blocks in the object store
    if args.map:
        dataset = dataset.map_batches(as_int64, batch_size=None)
    trainer.fit(batches[:3], skip=0)  # warm-up: stage 3 records its module trace
    tokens = args.batch_size * args.seq_len
    print(f"GPT {gpt.num_params(cfg) / 1e6:.2f}M params, ZeRO stage {args.stage}, {args.num_workers} workers, "
          f"global batch {args.batch_size} x {args.seq_len} = {tokens} tokens, {args.steps} steps per run")
    print(f"{'input':9} {'fit wall s':>10} {'steady s/step':>14} {'steps/s':>8} {'tokens/s':>9}")
    best = {}
    for _ in range(args.repeats):
        for name in ("step", "ray.data"):
            before = len(records(metrics))
            t0 = time.perf_counter()
            if name == "step":
                out = trainer.fit(batches, num_steps=args.steps, skip=0)
            else:
                out = trainer.fit(dataset, num_steps=args.steps, batch_size=args.batch_size, skip=0)
            wall = time.perf_counter() - t0
            assert len(out) == args.steps, (name, len(out))
            times = [r["time"] for r in records(metrics)[before:]]
            per_step = statistics.median(b - a for a, b in zip(times, times[1:]))  # after the first step
            best[name] = min(best.get(name, per_step), per_step)
            print(f"{name:9} {wall:10.2f} {per_step:14.4f} {1 / per_step:8.2f} {tokens / per_step:9.0f}", flush=True)
    trainer.shutdown()
    shutil.rmtree(os.path.dirname(metrics), ignore_errors=True)
    print("best steady state: " + ", ".join(f"{name} {1 / s:.2f} steps/s ({tokens / s:.0f} tokens/s)"
                                            for name, s in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
