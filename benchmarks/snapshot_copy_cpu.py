"""What one in-memory snapshot costs a worker in CPU time: the export of its state
plus Ray's store of the returned shard, measured in a Ray actor that does nothing else.

    PYTHONPATH=$PWD python benchmarks/snapshot_copy_cpu.py

The actor holds one engine (the main job's GPT, d_model 512, ``--layers`` 4, 8 heads: at one
rank that is 152 MB of master and Adam state, the share of a worker of the ``--large`` 8-layer
model at 2 workers in benchmarks/snapshot_cost.py), trained one step, and returns
``runtime.worker.snapshot_side.copy_shard`` as ``Worker.snapshot_shard`` does. The CPU seconds (the
actor process's, every thread: Ray's store may copy on several) and wall seconds run from the
capture until Ray lets go of the last returned array, which it does once it has stored them.
Also printed: the actor's minor page faults over the same span (pages it wrote for the first
time: the export's new tensors, and the object store's pages Ray writes the shard into). CPU
time is less sensitive to a busy machine than wall time, not immune (memory bandwidth is
shared). Whatever ``zeroray`` is on PYTHONPATH is measured, so the same command measures
another checkout (``git archive <commit> | tar -x -C DIR``, then ``PYTHONPATH=DIR``).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import sys
import threading
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples")]

import ray  # noqa: E402


@ray.remote
class Bench:
    def __init__(self, layers: int) -> None:
        import gpt
        import torch

        import zeroray as zr
        from zeroray.comm.group import SoloGroup
        from zeroray.engine.engine import Engine

        torch.set_num_threads(1)
        cfg = gpt.GPTConfig(seq_len=128, d_model=512, n_layers=layers, n_heads=8)
        self.engine = Engine(lambda: gpt.GPT(cfg), gpt.gpt_loss, zr.AdamW(lr=3e-4), zr.ZeroConfig(stage=3),
                             SoloGroup())
        self.engine.train_step(next(iter(gpt.CharBatches(batch_size=2, seq_len=128, num_steps=1, seed=0))))
        self.measured = []

    def where(self) -> str:
        import zeroray

        return zeroray.__file__

    def snap(self):
        from zeroray.runtime.worker.snapshot_side import capture, copy_shard

        t0, c0 = time.perf_counter(), time.process_time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        taken = capture(self.engine, 0)
        if "released" in inspect.signature(copy_shard).parameters:
            out = copy_shard(taken, released=lambda: None)
        else:
            out = copy_shard(taken)
        arrays = list(out[0]["tensors"].values())
        left, lock = [len(arrays)], threading.Lock()

        def gone() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self.measured.append((time.process_time() - c0, time.perf_counter() - t0,
                                          resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
        for a in arrays:
            weakref.finalize(a, gone)
        del arrays
        return out

    def report(self) -> dict:
        return {"measured": self.measured,
                "shard_mb": round(sum(t.numel() * 4 for t in self.engine.export_state()[0].values()) / 1e6, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    path = os.environ.get("PYTHONPATH", "")
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [path, os.path.join(ROOT, "examples")]))}})
    bench = Bench.remote(args.layers)
    print("zeroray in the actor:", ray.get(bench.where.remote()), flush=True)
    held = None
    for _ in range(args.repeats + 1):  # the first is a warm-up (first touch of the store's pages)
        refs = bench.snap.options(num_returns=3).remote()
        ray.get(refs[2])
        held = refs  # one snapshot held at a time, as the driver does; the one before is freed
    del held
    report = ray.get(bench.report.remote())
    cpu, wall, faults = zip(*report["measured"][1:])
    print(f"SNAPSHOT_COPY_CPU {json.dumps({'shard_mb': report['shard_mb'], 'cpu_s_median': round(statistics.median(cpu), 3), 'cpu_s': [round(c, 3) for c in cpu], 'wall_s_median': round(statistics.median(wall), 3), 'minor_faults_median': statistics.median(faults), 'load': [round(x, 1) for x in os.getloadavg()]})}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
