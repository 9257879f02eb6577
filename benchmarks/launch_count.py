"""Collective launches and host synchronisations per step, counted on CPU (issue 14 item 2).

    python benchmarks/launch_count.py [--d-model 2048] [--layers 2] [--heads 16] [--seq-len 64]
        [--stages 0,1,2,3] [--dtype bf16]

On a GPU every collective costs host time to launch (the H200 profile in the issue:
about 63 us per NCCL collective), and every host synchronisation stalls the queue of
kernels. Both are counts the code fixes, not timings, so they can be taken here: the engine
runs over a real world-1 gloo process group (the same code path as NCCL at world 1, with
the collectives counted by the group), and a TorchFunctionMode counts the calls that
synchronise with the device on CUDA (``item``, ``tolist``, ``__float__``/``__int__``/
``__bool__`` of a tensor, ``cpu``). The model is examples/gpt.py at the width of the
808M-parameter GPT of the H200 runs (d_model 2048, 16 heads) with few layers, so that it
fits in memory here; per-layer figures scale to 16 layers.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (os.path.join(ROOT, "examples"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import gpt  # noqa: E402

import zeroray as zr  # noqa: E402
from zeroray.comm.group import TorchGroup  # noqa: E402
from zeroray.engine.engine import Engine  # noqa: E402

SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
           torch.Tensor.__bool__, torch.Tensor.cpu}


class SyncCounter(TorchFunctionMode):
    """Counts the tensor calls that wait for the device on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.calls[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def world_one_group() -> TorchGroup:
    import torch.distributed as dist

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=60))
    # point_to_point=False: at world size 1 the exchange has no peers; gloo's own collectives count the same.
    return TorchGroup(pg, 0, 1, "gloo", point_to_point=False, store=store)


def count(stage: int, args) -> dict:
    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    group = world_one_group()
    engine = Engine(functools.partial(gpt.GPT, cfg), gpt.gpt_loss, zr.AdamW(lr=1e-4),
                    zr.ZeroConfig(stage=stage, dtype=args.dtype), group)
    batches = list(gpt.CharBatches(2, cfg.seq_len, 3, seed=0))
    for batch in batches[:2]:  # the first step records the trace (stage 3); the second follows it
        engine.train_step(batch)
    syncs = SyncCounter()
    with syncs:
        engine.train_step(batches[2])
    calls = {k: v.calls for k, v in group.counter.collectives.items()}
    engine.close()
    group.close()
    return {"collectives": calls, "syncs": dict(syncs.calls)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"GPT d_model={args.d_model} layers={args.layers} heads={args.heads}, {args.dtype}, one step after "
          f"the first, world size 1 (gloo, counted)")
    print(f"{'stage':6s} {'all_gather':>10s} {'reduce_scatter':>14s} {'all_reduce':>10s} {'control':>8s} "
          f"{'per layer (ag+rs)':>18s}  host syncs")
    for stage in (int(s) for s in args.stages.split(",")):
        out = count(stage, args)
        c = out["collectives"]
        ag, rs, ar = c.get("all_gather", 0), c.get("reduce_scatter", 0), c.get("all_reduce", 0)
        control = c.get("control_all_reduce", 0) + c.get("control_all_gather", 0)
        print(f"{stage:<6d} {ag:>10d} {rs:>14d} {ar:>10d} {control:>8d} {(ag + rs) / args.layers:>18.1f}  "
              f"{sum(out['syncs'].values())} {out['syncs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
