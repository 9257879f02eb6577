"""What glibc's heap trimming costs a step: each row in processes of its own, rows in turns, several rounds.

    MODEL=mha python benchmarks/heap_trim.py                 # s0, s3@131072, s3; 2 rounds
    MODEL=hf-gpt2 ROUNDS=3 python benchmarks/heap_trim.py s0 s3@131072 s3

Each argument is a row ``s<stage>[@<trim threshold bytes>]``: the engine alone (no Ray) in two
spawned gloo processes of its own, as a zeroray worker is a process of its own (glibc's allocator
is process-wide). With ``@bytes``, glibc's trim threshold is set to that after the engine is built
(``mallopt(M_TRIM_THRESHOLD)``): ``s3@131072`` is stage 3 as it was before ``MappedBlocks`` fixed
the trim threshold too (fixing the mmap threshold had left it at glibc's initial 128 KiB, so the
activations a backward frees at the top of the heap went back to the OS and were faulted in again
at the next step; [Note: process memory] in zeroray/memory/process.py). The rows run one after
another, ROUNDS times (default 2), so that a change in the machine's load falls on all of them.
Per row and round, rank 0's medians over the timed steps: cpu (the process's CPU seconds over the
step, every thread; on a loaded machine it still says what a step costs), main_cpu (the stepping
thread's), minflt (minor page faults: pages the step had to fault in, kernel-zeroed), wall.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
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

from common import BenchSpec, global_batches, model_fn, worker_slice  # noqa: E402

_M_TRIM_THRESHOLD = -1  # mallopt's parameter number (malloc.h)


def _parse(row: str):
    stage, _, trim = row.partition("@")
    if stage[:1] != "s" or stage[1:] not in ("0", "1", "2", "3") or (trim and not trim.isdigit()):
        raise SystemExit(f"unknown row {row!r}: use s<stage>[@<trim threshold bytes>], e.g. s3@131072")
    return int(stage[1:]), int(trim) if trim else None


def _rank(rank: int, world: int, port: int, row: str, spec: BenchSpec, out: str) -> None:
    import zeroray as zr
    from bench_models import lm_loss
    from zeroray.comm.group import make_torch_group
    from zeroray.engine.engine import Engine

    torch.set_num_threads(1)
    stage, trim = _parse(row)
    group = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    engine = Engine(model_fn(spec), lm_loss, zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                    zr.ZeroConfig(stage=stage), group, seed=spec.seed)
    if trim is not None:
        ctypes.CDLL(None).mallopt(_M_TRIM_THRESHOLD, trim)
    steps = []
    for i, batch in enumerate(global_batches(spec)):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        engine.train_step(worker_slice(batch, rank, spec))
        if i >= spec.warmup_steps:
            steps.append({"cpu": time.process_time() - c0, "main_cpu": time.thread_time() - m0,
                          "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                          "wall": time.perf_counter() - t0})
    engine.close()
    group.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(steps, f)


def _run_row(row: str, spec: BenchSpec, world: int) -> dict:
    from zeroray.comm.port import free_port

    out = os.path.join(tempfile.mkdtemp(prefix="zr-trim-"), "out.json")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, row, spec, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"row {row}: a rank failed: exit codes {[p.exitcode for p in procs]}")
    with open(out) as f:
        steps = json.load(f)
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]}


def main(argv=None) -> int:
    rows = list(sys.argv[1:] if argv is None else argv) or ["s0", "s3@131072", "s3"]
    for row in rows:
        _parse(row)
    world = int(os.environ.get("WORLD", "2"))
    spec = BenchSpec(model=os.environ.get("MODEL", "mha"), num_workers=world,
                     timed_steps=int(os.environ.get("STEPS", "8")))
    print(f"{spec.model}, {world} gloo processes per row, rank 0's medians over {spec.timed_steps} steps")
    for round_ in range(int(os.environ.get("ROUNDS", "2"))):
        for row in rows:
            result = _run_row(row, spec, world)
            print(f"round {round_} {row:>10}", "  ".join(f"{k} {v:.4g}" for k, v in result.items()),
                  f" (load average {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
