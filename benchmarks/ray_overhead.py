"""What Ray costs per step: the engine in-process vs ``Trainer.step`` vs ``Trainer.fit`` (1 worker).

The same GPT (examples/gpt.py), config, seed and batches run three ways, at the same torch
thread count, one after another in each round:

- ``engine``: ``zeroray.engine.engine.Engine`` in this process on a ``SoloGroup`` (world size 1), no
  Ray: the floor. Timed around ``train_step`` (with a CUDA sync on a GPU).
- ``step``: ``zr.Trainer`` with one worker actor, ``ScalingConfig(threads_per_worker=T)``;
  timed around ``trainer.step(batch)`` on the driver (the batch goes through the object store).
- ``fit``: the same Trainer's ``fit(list_of_batches, num_steps=S)``: its wall time over S.

For ``step`` it also prints where each step's time goes, from the timestamps every step
carries (``StepResult.timeline``): driver submit -> actor start (dispatch: the call and its
batch reach the actor) -> engine start (waiting for the engine) -> engine end (the engine's
own step) -> actor end -> driver receive (the result comes back). All are ``time.time()``
on one machine, so the hops of different processes compare.

For ``fit`` it prints how long the worker sat idle between two steps (the pipeline's bubble)
and the engine's own time per step inside the actor, and for ``step`` and ``fit`` the CPU
time per step of the driver and of the worker actor: on a machine with fewer free cores than
processes, the driver's and Ray's own work competes with the engine for a core, which shows as
a slower engine, not as a gap between steps.

Figures are medians over the timed steps of every round; the ratios are also given per
round. Machine noise moves them: prefer ``--rounds 3`` and read the ratios, not the seconds.

    python benchmarks/ray_overhead.py                       # d_model 256, 4 layers, batch 8 x 64, 1 thread
    python benchmarks/ray_overhead.py --rounds 3 --steps 30
    python benchmarks/ray_overhead.py --d-model 64 --layers 2 --batch 2 --seq-len 32   # a very short step
    python benchmarks/ray_overhead.py --device cuda --d-model 1024 --layers 8 --seq-len 1024 --dtype bf16
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import torch  # noqa: E402

import gpt  # noqa: E402
import zeroray as zr  # noqa: E402
from zeroray.comm.group import SoloGroup  # noqa: E402
from zeroray.engine.engine import Engine  # noqa: E402
from benchmarks.common import proc_stat  # noqa: E402

HOPS = (("dispatch", "submit", "actor_start"), ("queue", "actor_start", "engine_start"),
        ("engine", "engine_start", "engine_end"), ("return", "engine_end", "receive"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads, in this process and in the actor")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    return p.parse_args(argv)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_engine(engine: Engine, batches, device: str) -> list:
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        engine.train_step(batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process on this machine has used so far."""
    return proc_stat(pid).cpu_s


class CpuMeter:
    """CPU seconds per step of the driver (this process) and of the worker actor, over a block of steps."""

    def __init__(self, actor_pid: int) -> None:
        self.actor_pid = actor_pid
        self.per_step = {"driver": [], "actor": []}

    def measure(self, run, steps: int):
        d0, a0 = time.process_time(), process_cpu_s(self.actor_pid)
        out = run()
        self.per_step["driver"].append((time.process_time() - d0) / steps)
        self.per_step["actor"].append((process_cpu_s(self.actor_pid) - a0) / steps)
        return out


def time_step(trainer, batches) -> tuple:
    times, timelines = [], []
    for batch in batches:
        t0 = time.perf_counter()
        result = trainer.step(batch)
        float(result.loss)
        times.append(time.perf_counter() - t0)
        timelines.append(result.timeline)
    return times, timelines


class Sleeper:
    """A bare actor whose call sleeps as long as a step: Ray's own round trip, nothing of zeroray's."""

    def nap(self, seconds: float, batch) -> dict:
        start = time.time()
        time.sleep(seconds)
        return {"actor_start": start, "actor_end": time.time()}


def ray_floor(step_s: float, batches, rounds: int = 20) -> tuple:
    """Median (dispatch, return) of a bare actor call that carries a batch and sleeps ``step_s``."""
    import ray

    actor = ray.remote(Sleeper).options(num_cpus=0).remote()
    ray.get(actor.nap.remote(0.0, None))
    dispatch, back = [], []
    for batch in batches[:rounds]:
        arg = tuple(t.numpy() for t in batch)
        submit = time.time()
        hops = ray.get(actor.nap.remote(step_s, arg))
        receive = time.time()
        dispatch.append(hops["actor_start"] - submit)
        back.append(receive - hops["actor_end"])
    ray.kill(actor)
    return statistics.median(dispatch), statistics.median(back)


def time_fit(trainer, batches) -> tuple:
    t0 = time.perf_counter()
    results = trainer.fit(batches, num_steps=len(batches), skip=0)
    assert len(results) == len(batches)
    return (time.perf_counter() - t0) / len(batches), [r.timeline for r in results]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("zeroray").setLevel(logging.WARNING)  # fit's progress lines would time the terminal
    torch.set_num_threads(args.threads)
    cfg = gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model_fn = lambda: gpt.GPT(cfg)  # noqa: E731
    optimizer = zr.AdamW(lr=1e-3)
    zero = zr.ZeroConfig(stage=args.stage, dtype=args.dtype)
    total = args.warmup + args.steps
    batches = list(gpt.CharBatches(args.batch, args.seq_len, total, seed=0))
    print(f"GPT {gpt.num_params(cfg) / 1e6:.2f}M params, stage {args.stage}, {args.dtype}, {args.device}, "
          f"batch {args.batch} x {args.seq_len}, {args.threads} torch thread(s), {args.steps} timed steps "
          f"x {args.rounds} round(s)", flush=True)

    device = "cuda:0" if args.device == "cuda" else "cpu"
    engine = Engine(model_fn, gpt.gpt_loss, optimizer, zero, SoloGroup(), seed=0, device=device)
    t0 = time.perf_counter()
    trainer = zr.Trainer(model_fn, gpt.gpt_loss, optimizer=optimizer, zero=zero,
                         scaling=zr.ScalingConfig(num_workers=1, threads_per_worker=args.threads,
                                                  use_gpu=args.device == "cuda"))
    print(f"Trainer with 1 worker up in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    trainer.fit(batches[:args.warmup], skip=0, progress=False)  # also stage 3's trace recording
    first_fit = time.perf_counter() - t0
    print(f"first fit on a list ({args.warmup} steps): {first_fit:.2f} s; ray.data imported: "
          f"{'ray.data' in sys.modules}", flush=True)

    pooled = {"engine": [], "step": [], "fit": []}
    cpu = {"step": CpuMeter(trainer.workers[0]["pid"]), "fit": CpuMeter(trainer.workers[0]["pid"])}
    timelines, fit_timelines = [], []
    print(f"{'round':>5} {'engine ms':>10} {'step ms':>9} {'fit ms':>8} {'step-engine ms':>15} "
          f"{'step/engine':>12} {'fit/engine':>11}")
    for r in range(args.rounds):
        time_engine(engine, batches[:args.warmup], args.device)
        e = time_engine(engine, batches[args.warmup:], args.device)
        time_step(trainer, batches[:args.warmup])
        s, tl = cpu["step"].measure(lambda: time_step(trainer, batches[args.warmup:]), args.steps)
        f, ftl = cpu["fit"].measure(lambda: time_fit(trainer, batches[args.warmup:]), args.steps)
        pooled["engine"] += e
        pooled["step"] += s
        pooled["fit"].append(f)
        timelines += tl
        fit_timelines += ftl
        me, ms = statistics.median(e), statistics.median(s)
        print(f"{r:5d} {me * 1e3:10.2f} {ms * 1e3:9.2f} {f * 1e3:8.2f} {(ms - me) * 1e3:15.2f} "
              f"{ms / me:12.3f} {f / me:11.3f}", flush=True)
    me, ms, mf = (statistics.median(pooled[k]) for k in ("engine", "step", "fit"))
    print(f"{'all':>5} {me * 1e3:10.2f} {ms * 1e3:9.2f} {mf * 1e3:8.2f} {(ms - me) * 1e3:15.2f} "
          f"{ms / me:12.3f} {mf / me:11.3f}")
    print("\nwhere a Trainer.step goes (median over the timed steps, ms):")
    for name, a, b in HOPS:
        print(f"  {name:9} {a} -> {b}: {statistics.median(t[b] - t[a] for t in timelines) * 1e3:8.3f}")
    print(f"  {'total':9} submit -> receive: "
          f"{statistics.median(t['receive'] - t['submit'] for t in timelines) * 1e3:8.3f}")
    floor_in, floor_out = ray_floor(me, batches)
    print(f"  Ray's own floor, a bare actor call that sleeps {me * 1e3:.1f} ms: dispatch {floor_in * 1e3:.3f}, "
          f"return {floor_out * 1e3:.3f}")
    engine_fit = statistics.median(t["engine_end"] - t["engine_start"] for t in fit_timelines)
    gaps = [b["engine_start"] - a["engine_end"] for a, b in zip(fit_timelines, fit_timelines[1:])
            if b["submit"] < a["engine_end"]]  # consecutive steps of one fit
    print(f"in fit (steps pipelined): engine {engine_fit * 1e3:.3f} ms per step, the worker idle between "
          f"two steps {statistics.median(gaps) * 1e3:.3f} ms (median), "
          f"the next call queued before the current step ended in {len(gaps)} of {len(fit_timelines) - 1}")
    period = statistics.median(b["engine_start"] - a["engine_start"] for a, b in zip(fit_timelines, fit_timelines[1:])
                               if b["submit"] < a["engine_end"])
    print(f"  the worker's step period in fit {period * 1e3:.3f} ms = {period / engine_fit:.3f} x its engine time "
          f"there, {period / me:.3f} x the engine in-process")
    for row in ("step", "fit"):
        per = cpu[row].per_step
        print(f"CPU per step in {row}: driver {statistics.median(per['driver']) * 1e3:.2f} ms, worker actor "
              f"{statistics.median(per['actor']) * 1e3:.2f} ms (engine in-process: {me * 1e3:.2f} ms wall)")
    print(f"ray.data imported by the end: {'ray.data' in sys.modules}")
    engine.close()
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
