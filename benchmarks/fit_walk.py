"""The fit walk: the files of ``zeroray/runtime/`` one fit passes through, in order (docs/architecture.md).

A profiler hook (``sys.setprofile``) on the driver follows control through one ``trainer.fit``
from the moment it enters ``run_fit``, as a reader follows the code: each function is read once,
at its first call (a second call of it, the next step's, and everything under that call are
skipped: the reader knows them already). At every call the walk moves into the callee's file,
at every return back into the caller's. Only files under ``zeroray/runtime/`` are recorded (time
spent in torch, ray or the layers below is not a stop); consecutive events in one file are one
stop. Then: ``stops`` (the path's length), ``files`` (distinct ones) and ``returns`` (stops in a
file the path had already left). The fit is the one a reader follows: 2 workers, 2 steps on a
list of batches, an in-memory snapshot behind every step, a checkpoint after the last one and
an evaluation at the end, so every kind of stop is on it once; the trainer's workers are
started (and its first step taken) before the trace begins.

    python benchmarks/fit_walk.py             # this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/fit_walk.py   # another tree, the same way
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from typing import List

import torch

import zeroray as zr


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def walk(steps: int = 2) -> List[str]:
    """The runtime files one fit passes through, in order (see the module docstring)."""
    root = os.path.join(os.path.dirname(os.path.abspath(zr.__file__)), "runtime") + os.sep
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]
    path: List[str] = []
    started = [False]

    def where(filename: str) -> None:
        if not filename.startswith(root):
            return
        name = filename[len(root):]
        if not started[0]:
            if not name.endswith(("fit_loop.py", os.path.join("fit", "loop.py"))):
                return
            started[0] = True
        if not path or path[-1] != name:
            path.append(name)

    read: set = set()      # the functions read already (their code objects)
    skipped: set = set()   # the frames inside a function read before

    def profile(frame, event, arg) -> None:
        if event == "call":
            if id(frame.f_back) in skipped or (started[0] and frame.f_code in read):
                skipped.add(id(frame))
                return
            where(frame.f_code.co_filename)
            if started[0] and frame.f_code.co_filename.startswith(root):
                read.add(frame.f_code)
        elif event == "return":
            if id(frame) in skipped:
                skipped.discard(id(frame))
                return
            if frame.f_back is not None:
                where(frame.f_back.f_code.co_filename)

    with tempfile.TemporaryDirectory() as ckpt:
        trainer = zr.Trainer(lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)),
                             _loss, zero=zr.ZeroConfig(stage=2), scaling=zr.ScalingConfig(num_workers=2),
                             failure=zr.FailureConfig(snapshot_every=1),
                             checkpoint=zr.CheckpointConfig(path=ckpt, every_steps=steps))
        try:
            trainer.step(batches[0])  # the workers started and warm: the walk is fit's alone
            sys.setprofile(profile)
            try:
                trainer.fit(batches, eval_data=batches[:1], progress=False)
            finally:
                sys.setprofile(None)
        finally:
            trainer.shutdown()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the path")
    args = parser.parse_args()
    path = walk(args.steps)
    seen, returns = set(), Counter()
    for name in path:
        if name in seen:
            returns[name] += 1
        seen.add(name)
    summary = {"stops": len(path), "files": len(seen), "returns": sum(returns.values()),
               "returns_by_file": dict(returns.most_common())}
    if args.json:
        print(json.dumps({**summary, "path": path}))
        return
    for i, name in enumerate(path, 1):
        print(f"{i:3d} {name}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
