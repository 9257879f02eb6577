"""What the disk tier's optimizer step leaves in the heap: the stage-3 offload stepper alone.

    python benchmarks/offload_heap.py [--numel 31.6e6] [--steps 3] [--chunk-mb 16]

One process per row (the allocator's thresholds are process-wide), each on a thread of its own
(a malloc arena of its own, as the worker's compute thread has: memory/process.py): the fp32
parameter shard in a file (offload/shard.py, its buffers mapped by ``MappedBlocks``, as
engine/storage.py builds it at stage 3 with offload="disk") and the disk stepper over it with
fused AdamW (offload/stepper.py), stepped ``--steps`` times on a random gradient. After each
step: the bytes glibc's arenas hold from the OS (``mallinfo2().arena``: the heap, not the mapped
blocks), the part of them free (``fordblks``), and the process's RSS, each less its value before
the first step; and what the stepper's slots hold (the tier's three chunks, which the model
states count). Rows: ``fresh`` (today's stepper: a stateless chunk's step, where torch makes its
state, runs inside the shard's ``mapped``) and ``as before`` (that context taken out: torch's
fresh state from the heap), [Note: fresh state off the heap] in zeroray/offload/stepper.py.
Nothing else runs in the process, so what the heap gains is the stepper's.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading

MB = 1e6


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict:
    """glibc's arenas, all of them: bytes from the OS (``arena``) and free in them (``fordblks``); RSS."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"arena": m.arena, "free": m.fordblks, "rss": rss}


def one_row(numel: int, steps: int, chunk_bytes: int, as_before: bool) -> dict:
    import torch

    from zeroray.memory.process import MappedBlocks
    from zeroray.offload.shard import DiskShard
    from zeroray.offload.stepper import make_stepper

    torch.set_num_threads(1)
    out: dict = {}

    def run() -> None:
        mapped = MappedBlocks().mapped
        shard = DiskShard(torch.randn(numel), None, 0, mapped=mapped)
        param = torch.nn.Parameter(torch.zeros(1).expand(numel))  # a placeholder, as DiskMaster's slices
        piece = type("Piece", (), {"start": 0, "end": numel, "param": param})()
        builder = lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, fused=True)  # noqa: E731
        inner = builder([{"params": [param]}])
        disk = make_stepper(builder, [{}], None, 0, numel, chunk_bytes, target=shard)
        if as_before:
            disk.fresh = contextlib.nullcontext
        grad = torch.randn(numel)
        before, rows = heap(), []
        for _ in range(steps):
            param.grad = grad
            disk.prefetch([piece])
            disk.step(inner, [piece])
            disk.drain()
            now = heap()
            rows.append({k: now[k] - before[k] for k in now})
        out.update(chunks=-(-numel // disk.chunk_elems), chunk_elems=disk.chunk_elems,
                   slots=disk.stats()["buffer_bytes"], steps=rows)
        disk.close()
        shard.close()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=31.6e6, help="fp32 elements of the shard (default 31.6e6: "
                                                               "fits.py's 24-layer GPT over 2 workers, about)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=16, help="ZeroConfig.offload_chunk_bytes, MiB (default 16)")
    p.add_argument("--row", choices=("fresh", "as_before"), help=argparse.SUPPRESS)  # one row, in a child
    args = p.parse_args(argv)
    numel, chunk = int(args.numel), int(args.chunk_mb * 2**20)
    if args.row:
        print(json.dumps(one_row(numel, args.steps, chunk, args.row == "as_before")))
        return 0
    print(f"disk stepper alone, stage 3 fp32: {numel:,} elements, fused AdamW, {args.steps} steps; MB after each "
          "step, less before the first")
    for row in ("fresh", "as_before"):
        res = subprocess.run([sys.executable, __file__, "--row", row, "--numel", str(numel), "--steps",
                              str(args.steps), "--chunk-mb", str(args.chunk_mb)],
                             capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        steps = "; ".join(f"heap +{s['arena'] / MB:.0f} (free {s['free'] / MB:.0f}), RSS +{s['rss'] / MB:.0f}"
                          for s in r["steps"])
        print(f"  {row.replace('_', ' '):9s} ({r['chunks']} chunks of {r['chunk_elems']:,}, slots "
              f"{r['slots'] / MB:.0f} MB): {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
