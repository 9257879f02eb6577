"""The CPU optimizer step's throughput: zeroray's flat optimizer in memory and with offload="disk"
beside torch.optim.AdamW (foreach and fused), on one flat fp32 segment of each size.

    python benchmarks/cpu_adam.py [--sizes 1,4,16,64] [--steps 5] [--threads N] [--json out.json]

Sizes are in millions of elements. Each row builds its optimizer over a fresh parameter of that
size with a random gradient, takes one step (torch makes the state lazily: not timed), then times
``--steps`` steps and reports the median, as elements per second. Rows:

- torch foreach / torch fused: ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)`` on the
  parameter;
- zr memory: zeroray's ShardedOptimizer over the parameter as one segment (zr.AdamW: the fused
  kernel), state in memory;
- zr disk: the same with offload="disk" in the default chunks (16 MiB of state per chunk,
  offload/stepper.py), the state files in ``--dir`` (default: the system's temporary directory).
  Its reads are served by the page cache when the files fit in it (they do here);
- zr disk cold: the same, but after each step the files are flushed and dropped from the page
  cache (fsync + posix_fadvise DONTNEED), so every read comes from the device.

For the disk rows it also prints the share of the step spent waiting for I/O.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import zeroray as zr  # noqa: E402
from zeroray.engine.optim import DiskOffload, Segment, ShardedOptimizer  # noqa: E402

LR = dict(lr=1e-3, weight_decay=0.01)


def _torch_row(kind: str, n: int, steps: int):
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], **LR, **{kind: True})
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), None


def _zr_row(n: int, steps: int, folder, cold: bool):
    master, grad = torch.randn(n), torch.randn(n)
    offload = DiskOffload(folder, 0, zr.ZeroConfig(offload="disk").offload_chunk_bytes) if folder else None
    opt = ShardedOptimizer(zr.AdamW(**LR), master, grad, [Segment(0, n, ())], None, param_spans={"w": (0, n)},
                           offload=offload)
    opt.step(1.0)
    times, waits = [], []
    for _ in range(steps):
        if cold:
            for fd in opt.disk.files.fds.values():
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = opt.offload_stats().get("wait_s", 0.0)
        t0 = time.perf_counter()
        opt.step(1.0)
        times.append(time.perf_counter() - t0)
        waits.append(opt.offload_stats().get("wait_s", 0.0) - before)
    med = statistics.median(times)
    wait = statistics.median(waits) / med if folder else None
    opt.close()
    return med, wait


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,16,64", help="millions of elements, comma-separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--dir", default=None, help="where the disk rows' state files go")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.dir or tempfile.gettempdir()
    rows = {"torch foreach": lambda n: _torch_row("foreach", n, args.steps),
            "torch fused": lambda n: _torch_row("fused", n, args.steps),
            "zr memory": lambda n: _zr_row(n, args.steps, None, False),
            "zr disk": lambda n: _zr_row(n, args.steps, folder, False),
            "zr disk cold": lambda n: _zr_row(n, args.steps, folder, True)}
    sizes = [int(float(s) * 1_000_000) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} steps; "
          f"Melem/s (I/O wait share of the step for disk rows)")
    print(f"{'row':<14}" + "".join(f"{n / 1e6:>16.0f}M" for n in sizes))
    out = {}
    for name, fn in rows.items():
        cells = []
        for n in sizes:
            med, wait = fn(n)
            out.setdefault(name, {})[n] = {"seconds": med, "elements_per_s": n / med, "wait_share": wait}
            cells.append(f"{n / med / 1e6:>10.0f}" + (f" ({wait:4.0%})" if wait is not None else " " * 7))
        print(f"{name:<14}" + "".join(f"{c:>17}" for c in cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
