"""Where one step's time goes, per phase, for the engine alone (no Ray) and for torch DDP.

    python benchmarks/engine_phases.py ddp s1 s3 's3{"prefetch": false}' [--large]
    PROF=1 python benchmarks/engine_phases.py s3      # also cProfile rank 0's timed steps
    MODEL=mha python benchmarks/engine_phases.py ddp s0   # another model of bench_models.py
    WORLD=3 MODEL=mha python benchmarks/engine_phases.py s0 s3   # 3 processes (default 2)

Each argument is a row run in the same WORLD (2) spawned gloo processes, one after another: ``ddp``,
``coll`` (13 MB all-reduce / reduce-scatter / all-gather), or ``s<stage>`` optionally followed
by ZeroConfig overrides as JSON. Per row it prints rank 0's medians over the timed steps, in
seconds: cpu (the process's CPU time over the step, every thread: on a loaded machine it still
says what a step costs, where wall time says how the cores were shared), fwd (loss_fn), bwd (the rest: backward with the gradient hooks, and the step's status
all-reduce), finish (the last buckets), norm (this rank's squared norm), opt, publish (stages 1-2
gather launch), total; for zeroray also ``exposed`` and ``comm``
(comm_report's exposed_s and comm_s), the step's collectives by kind (``n_*``: calls), the stage 3
coordinator's counters (``c_*``; ``c_on_demand`` counts units, not collectives) and, with
offload="disk", the step's state I/O (``off_*``: bytes read and written, the I/O threads'
seconds, the seconds the step waited for them; at stage 3 also the parameter shard's,
``off_shard_*``: bytes, I/O seconds, the gathers' wait for reads, and the slices read ahead
(hits) or when sent (misses)). Without
Ray, this separates the engine's cost from the runtime's; ``exposed`` with prefetch on and off
is the issue's "exposed communication" comparison as a median over steps.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import BenchSpec, build_model, global_batches, worker_slice  # noqa: E402


def _medians(rows: list, warmup: int) -> dict:
    return {k: statistics.median(r[k] for r in rows[warmup:]) for k in rows[-1]}


def collectives_row(rank: int, world: int, port: int) -> dict:
    """13 MB (the default model's gradients) through each collective the stages use."""
    from zeroray.comm.group import make_torch_group

    group = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    n = 13_000_000 // 4 // world * world
    full, shard, gathered = torch.randn(n), torch.empty(n // world), torch.empty(n)
    calls = {"all_reduce": lambda: group.all_reduce(full),
             "reduce_scatter": lambda: group.reduce_scatter(shard, full),
             "all_gather": lambda: group.all_gather(gathered, shard)}
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[2:])
    group.close()
    return out


def engine_row(rank: int, world: int, port: int, stage: int, spec: BenchSpec, overrides: dict) -> dict:
    import zeroray as zr
    from bench_models import lm_loss
    from common import model_fn
    from zeroray.comm.group import make_torch_group
    from zeroray.engine.engine import Engine
    from zeroray.fetch.publish import UpdatePublisher

    group = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    phases: dict = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
            return result
        return wrapper

    engine = Engine(model_fn(spec), timed("fwd", lm_loss),
                    zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                    zr.ZeroConfig(stage=stage, **overrides), group, seed=spec.seed)
    engine.reducer.finish = timed("finish", engine.reducer.finish)
    engine.optimizer.local_sumsq = timed("norm", engine.optimizer.local_sumsq)
    engine.optimizer.step = timed("opt", engine.optimizer.step)
    if isinstance(engine.coordinator, UpdatePublisher):  # stages 1-2
        engine.coordinator.publish = timed("publish", engine.coordinator.publish)
    profile = cProfile.Profile() if os.environ.get("PROF") and rank == 0 else None
    rows = []
    for i, batch in enumerate(global_batches(spec)):
        phases.clear()
        profiling = profile is not None and i >= spec.warmup_steps
        if profiling:
            profile.enable()
        offload_before = engine.offload_stats()
        c0, t0 = time.process_time(), time.perf_counter()
        engine.train_step(worker_slice(batch, rank, spec))
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        offload_after = engine.offload_stats()
        if profiling:
            profile.disable()
        row = {**phases, "total": total, "bwd": total - sum(phases.values()), "cpu": cpu}
        row.update({"c_" + k: v for k, v in engine.fetch_stats().items()})
        row["exposed"], row["comm"] = group.counter.wait_s, group.counter.comm_s
        # this step's collectives by kind (n_all_gather: stage 3's gathers, on demand and prefetched)
        row.update({"n_" + k: float(v.calls) for k, v in group.counter.collectives.items()})
        # offload="disk": this step's state I/O (bytes, the pool's I/O seconds, the step's wait for it)
        row.update({"off_" + k: offload_after[k] - offload_before[k]
                    for k in ("bytes_read", "bytes_written", "io_s", "wait_s", "shard_bytes_read",
                              "shard_bytes_written", "shard_io_s", "shard_wait_s", "shard_hits", "shard_misses")
                    if k in offload_after})
        rows.append(row)
    engine.close()
    group.close()
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return _medians(rows, spec.warmup_steps)


def ddp_row(rank: int, world: int, port: int, spec: BenchSpec) -> dict:
    import torch.distributed as dist
    from bench_models import lm_loss as gpt_loss
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = DDP(build_model(spec))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    rows = []
    for batch in global_batches(spec):
        c0, t0 = time.process_time(), time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = gpt_loss(model, worker_slice(batch, rank, spec))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        loss.item()
        t3 = time.perf_counter()
        rows.append({"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "total": t3 - t0, "cpu": time.process_time() - c0})
    dist.destroy_process_group()
    return _medians(rows, spec.warmup_steps)


def _rank(rank: int, world: int, ports: list, rows: list, large: bool, out: str) -> None:
    torch.set_num_threads(1)
    model = os.environ.get("MODEL", "gpt")  # bench_models.MODELS
    spec = BenchSpec(d_model=512, n_layers=8, n_heads=8, timed_steps=8, model=model, num_workers=world) if large \
        else BenchSpec(timed_steps=10, model=model, num_workers=world)
    results = []
    for port, row in zip(ports, rows):
        if row == "coll":
            results.append(collectives_row(rank, world, port))
        elif row == "ddp":
            results.append(ddp_row(rank, world, port, spec))
        else:
            overrides = json.loads(row[2:]) if len(row) > 2 else {}
            results.append(engine_row(rank, world, port, int(row[1]), spec, overrides))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main(argv=None) -> int:
    from zeroray.comm.port import free_ports

    args = list(sys.argv[1:] if argv is None else argv)
    large = "--large" in args or bool(os.environ.get("LARGE"))
    rows = [a for a in args if a != "--large"] or ["ddp", "s1", "s3"]
    for row in rows:
        if row not in ("coll", "ddp") and not (row[:1] == "s" and row[1:2] in "0123" and len(row) >= 2):
            raise SystemExit(f"unknown row {row!r}: use coll, ddp, or s<stage>[JSON ZeroConfig overrides]")
    out = os.path.join(tempfile.mkdtemp(prefix="zr-phases-"), "out.json")
    ctx = mp.get_context("spawn")
    ports = free_ports(len(rows))
    world = int(os.environ.get("WORLD", "2"))
    procs = [ctx.Process(target=_rank, args=(r, world, ports, rows, large, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    with open(out) as f:
        for row, result in zip(rows, json.load(f)):
            print(row, {k: round(v, 4) for k, v in result.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
