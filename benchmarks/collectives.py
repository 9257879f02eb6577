"""Gloo's own reduce-scatter / all-gather against zeroray's point-to-point exchange.

    python benchmarks/collectives.py [--workers 2,3] [--mb 1,4,13,52]

Both sides of each row run through ``zeroray.comm.group.TorchGroup`` on one gloo process
group per world size, one thread per rank: ``point_to_point=False`` is the pg's
``_reduce_scatter_base`` / ``_allgather_base``, ``True`` the exchange of
[Note: gloo point-to-point]. All-reduce, which DDP uses, is printed for scale (gloo's own ring;
``all_reduce exchange`` is the engine's stage-0 call, the pair exchange at two ranks, gloo's at
more). Each figure is the median of 8 timed calls after 2 warm-up calls, in ms, measured on rank 0.
benchmarks/plan_measure.py reads the same rows (``_rank``) for the step simulator's α–β.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time(fn, reps: int = 10, warmup: int = 2) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]) * 1e3


def _rank(rank: int, world: int, port: int, sizes_mb, queue) -> None:
    torch.set_num_threads(1)
    from zeroray.comm.group import TorchGroup, make_torch_group

    native = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    p2p = TorchGroup(native.pg, rank, world, "gloo", point_to_point=True)
    native.exchange = None
    for mb in sizes_mb:
        n = int(mb * 1e6) // 4 // world * world
        torch.manual_seed(rank)
        full, shard = torch.randn(n), torch.empty(n // world)
        gathered, scratch = torch.empty(n), torch.empty(p2p.scratch_numel(n // world))
        expect = full.clone()
        native.all_reduce(expect)
        p2p.reduce_scatter(shard, full, scratch=scratch)
        assert torch.allclose(shard, expect.view(world, -1)[rank], rtol=1e-5, atol=1e-5), "exchange reduce-scatter is wrong"
        scratch_ar = full.clone()
        row = {"mb": mb, "world": world, "all_reduce": _time(lambda: native.all_reduce(scratch_ar))}
        pair = p2p.all_reduce_scratch_numel(n)
        ar_scratch = torch.empty(pair) if pair else None
        row["all_reduce exchange"] = _time(lambda: p2p.all_reduce(scratch_ar, scratch=ar_scratch))
        for name, g in (("gloo", native), ("exchange", p2p)):
            row[f"reduce_scatter {name}"] = _time(lambda: g.reduce_scatter(shard, full, scratch=scratch))
            row[f"all_gather {name}"] = _time(lambda: g.all_gather(gathered, shard))
        if rank == 0:
            queue.put(row)
    native.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,3")
    p.add_argument("--mb", default="1,4,13,52", help="payload sizes (full tensor), MB")
    args = p.parse_args(argv)
    from zeroray.comm.port import free_port

    ctx = mp.get_context("spawn")
    sizes = [float(x) for x in args.mb.split(",")]
    print(f"{'W':>2} {'MB':>5} {'all_reduce':>10} | {'RS gloo':>8} {'RS p2p':>8} {'x':>5} | {'AG gloo':>8} {'AG p2p':>8} {'x':>5}")
    for world in (int(w) for w in args.workers.split(",")):
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        for _ in sizes:
            r = queue.get(timeout=600)
            rs_g, rs_p, ag_g, ag_p = (r["reduce_scatter gloo"], r["reduce_scatter exchange"],
                                      r["all_gather gloo"], r["all_gather exchange"])
            print(f"{world:>2} {r['mb']:>5g} {r['all_reduce']:>10.2f} | {rs_g:>8.2f} {rs_p:>8.2f} {rs_g / rs_p:>5.2f} | "
                  f"{ag_g:>8.2f} {ag_p:>8.2f} {ag_g / ag_p:>5.2f}", flush=True)
        for proc in procs:
            proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
