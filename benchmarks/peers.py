"""The rows zeroray is measured against: the compute floor, torch DDP, torch FSDP2, DeepSpeed.

Each row runs in fresh spawned processes (one per worker; one for the floor), so every
process's peak RSS is its own and no row inherits another's threads or allocator state.
A rank writes its measurements to ``<out_dir>/rank<r>.json``; ``launch`` gathers them.
All ranks train on their slice of the same global batches (common.global_batches), with
``torch.manual_seed(seed); GPT(cfg)`` as the initial weights and torch AdamW.
"""
from __future__ import annotations

import inspect
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from typing import Callable, List, Optional

from common import (BenchSpec, StepClock, add_import_paths, build_model, current_rss_bytes,
                    global_batches, limit_threads, peak_rss_bytes, worker_slice)
from commcount import CommCounter
from zeroray.comm.port import free_port  # outside the ephemeral range: [Note: port outside the ephemeral range]


class PeerFailed(RuntimeError):
    pass


def launch(row: str, spec: BenchSpec, *, nprocs: int, timeout_s: float, extra: Optional[dict] = None) -> List[dict]:
    """Run ``row`` in ``nprocs`` spawned processes; return each rank's result, rank order."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"zr-bench-{row}-") as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(row, rank, nprocs, port, spec, extra or {}, out_dir),
                             name=f"bench-{row}-{rank}") for rank in range(nprocs)]
        for p in procs:
            p.start()
        _wait(procs, out_dir, timeout_s)
        return _collect(procs, out_dir, timeout_s)


class GatedRow:
    """A row whose ranks are started now and take each step only when told (compare.py
    ``--interleave``): every rank blocks on its pipe before each global batch, runs the step
    when ``step()`` sends the word, and answers once it is done. Blocked ranks use no CPU, so
    rows that live side by side and step in turns each see the machine alone, at the speed
    it has at that moment."""

    def __init__(self, row: str, spec: BenchSpec, *, nprocs: int, timeout_s: float,
                 extra: Optional[dict] = None) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.row, self.timeout_s = row, timeout_s
        self.out_dir = tempfile.mkdtemp(prefix=f"zr-bench-{row}-")
        self.conns, self.procs = [], []
        for rank in range(nprocs):
            mine, theirs = ctx.Pipe()
            self.conns.append(mine)
            self.procs.append(ctx.Process(target=_rank_main, name=f"bench-{row}-{rank}",
                                          args=(row, rank, nprocs, port, spec, extra or {}, self.out_dir, theirs)))
        for p in self.procs:
            p.start()

    def step(self) -> None:
        """One step on every rank; returns when every rank finished it."""
        for conn in self.conns:
            conn.send(True)
        for rank, conn in enumerate(self.conns):
            try:
                if not conn.poll(self.timeout_s):
                    raise PeerFailed(f"rank {rank}: no step done after {self.timeout_s:.0f}s (raise --timeout)")
                conn.recv()
            except (EOFError, OSError):
                self.close()
                results = _collect(self.procs, self.out_dir, self.timeout_s, check=False)
                errors = [r["error"] for r in results if "error" in r]
                raise PeerFailed(errors[0] if errors else f"rank {rank} exited during a step") from None

    def finish(self) -> List[dict]:
        """After the last step: each rank's result, rank order."""
        _wait(self.procs, self.out_dir, self.timeout_s)
        try:
            return _collect(self.procs, self.out_dir, self.timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        for p in self.procs:  # only the processes this row started
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.out_dir, ignore_errors=True)


def _collect(procs: list, out_dir: str, timeout_s: float, check: bool = True) -> List[dict]:
    """Each rank's result file; raises (``check``) if a rank failed, died or hung."""
    hung = [p for p in procs if p.is_alive()]
    for p in hung:  # only the processes the caller started
        p.kill()
        p.join()
    results = []
    for rank in range(len(procs)):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    if not check:
        return results
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise PeerFailed(errors[0])
    dead = [rank for rank, p in enumerate(procs) if p not in hung and not os.path.exists(
        os.path.join(out_dir, f"rank{rank}.json"))]
    if dead:
        raise PeerFailed(f"rank(s) {dead} died without a result, exit codes {[procs[r].exitcode for r in dead]}")
    if hung:
        raise PeerFailed(f"timed out after {timeout_s:.0f}s (raise --timeout)")
    return results


def _wait(procs: list, out_dir: str, timeout_s: float, grace_s: float = 15.0) -> None:
    """Until all ranks exit, the timeout passes, or one rank failed ``grace_s`` ago.

    A rank that fails leaves its peers blocked in a collective for gloo's own timeout
    (30 minutes); after the grace period they are abandoned (and killed by the caller).
    """
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(_failed(p, rank, out_dir) for rank, p in enumerate(procs)):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            return
        time.sleep(0.2)


def _failed(proc, rank: int, out_dir: str) -> bool:
    if proc.is_alive():
        return False
    if proc.exitcode != 0:
        return True
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            return "error" in json.load(f)
    except (OSError, ValueError):
        return True


def _rank_main(row: str, rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict, out_dir: str,
               gate=None) -> None:
    add_import_paths()
    limit_threads(spec.threads)
    try:
        result = _ROWS[row](rank, world_size, port, spec, {**extra, "gate": gate})
    except BaseException as e:  # reported to the parent, which prints it and goes on
        result = {"error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _train(model, optimizer, spec: BenchSpec, rank: int, *, step_fn: Optional[Callable] = None,
           counter: Optional[CommCounter] = None, gate=None) -> dict:
    """The timed loop every peer shares. ``step_fn(batch) -> loss`` defaults to plain torch.
    ``gate``: a pipe to the parent (GatedRow): wait for its word before each step, answer after."""
    from bench_models import lm_loss as gpt_loss

    opt_s = []  # the optimizer's share of each plain step ([Note: stage 3's bound] in compare.py)

    def torch_step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = gpt_loss(model, batch)
        loss.backward()
        t0 = time.perf_counter()
        optimizer.step()
        opt_s.append(time.perf_counter() - t0)
        return loss

    step_fn = step_fn or torch_step
    clock, losses, comm, idle_cpu = StepClock(spec.warmup_steps), [], None, []
    for batch in global_batches(spec):
        batch = worker_slice(batch, rank, spec)
        if counter is not None:
            counter.reset()
        if gate is not None:
            idle_from = time.process_time()
            gate.recv()
            idle_cpu.append(time.process_time() - idle_from)  # what this rank's threads did while held
        clock.start()
        loss = step_fn(batch)
        loss = loss.detach().item() if hasattr(loss, "detach") else float(loss)  # the step's work is done here
        clock.stop()
        if gate is not None:
            gate.send(loss)
        losses.append(loss)
        if counter is not None:
            comm = counter.report()  # the last step's, like zr.Trainer.comm_report()
    return {"step_s": clock.times, "cpu_s": clock.cpu_times, "losses": losses, "peak_rss_bytes": peak_rss_bytes(),
            "comm": comm, "idle_cpu_s": idle_cpu or None, "opt_s": opt_s or None}


def _init_group(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _adamw(params, spec: BenchSpec):
    import torch

    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def run_apart(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    """Every worker's compute and nothing else: W processes stepping at the same moments, each
    training a copy of its own on its own slice, no communication (their losses part after
    step 0). On a machine the workers fill, they compute slower than the floor alone."""
    base_rss = current_rss_bytes()
    model = build_model(spec)
    out = _train(model, _adamw(model.parameters(), spec), spec, rank, gate=extra.get("gate"))
    return {**out, "base_rss_bytes": base_rss}


def run_floor(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    """One process, one worker's batch (rank 0's slice), no communication at all."""
    return run_apart(0, world_size, port, spec, extra)


def run_ddp(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    counter = CommCounter().install()
    _init_group(rank, world_size, port)
    base_rss = current_rss_bytes()
    # No buffer sync before each forward: the only buffer (positions) never changes, and zeroray
    # does not re-send it either. (torch >= 2.13 renamed broadcast_buffers to forward_sync_buffers.)
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
               else {"broadcast_buffers": False})
    model = DDP(build_model(spec), **no_sync)

    def counting_allreduce_hook(_state, bucket):
        # DDP's default allreduce_hook, routed through dist.all_reduce so the counter sees it.
        buf = bucket.buffer().div_(world_size)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce_hook)
    try:
        out = _train(model, _adamw(model.parameters(), spec), spec, rank, counter=counter, gate=extra.get("gate"))
    finally:
        dist.destroy_process_group()
    return {**out, "base_rss_bytes": base_rss}


def run_fsdp2(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    counter = CommCounter().install()
    _init_group(rank, world_size, port)
    base_rss = current_rss_bytes()
    model = build_model(spec)
    import bench_models

    for block in bench_models.blocks(model):
        fully_shard(block)
    fully_shard(model)
    try:
        out = _train(model, _adamw(model.parameters(), spec), spec, rank, counter=counter, gate=extra.get("gate"))
    finally:
        dist.destroy_process_group()
    return {**out, "base_rss_bytes": base_rss}


def run_deepspeed(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    """DeepSpeed ZeRO ``extra['stage']`` on CPU: gloo, fp32, torch AdamW as client optimizer."""
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Before deepspeed binds torch.distributed functions into its comm backend.
    counter = CommCounter().install()
    import deepspeed
    import torch.distributed as dist
    from bench_models import lm_loss as gpt_loss

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    base_rss = current_rss_bytes()
    model = build_model(spec)
    config = {
        "train_micro_batch_size_per_gpu": spec.batch_per_worker,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": extra["stage"]},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        # DeepSpeed clips the gradient norm at 1.0 unless told otherwise; DDP, FSDP2 and zeroray
        # (max_grad_norm=None) do not clip, so neither does this row: the same step, the same losses.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), spec), config=config)

    def ds_step(batch):
        loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss

    try:
        out = _train(engine, None, spec, rank, step_fn=ds_step, counter=counter, gate=extra.get("gate"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {**out, "base_rss_bytes": base_rss}


def run_engine(rank: int, world_size: int, port: int, spec: BenchSpec, extra: dict) -> dict:
    """zeroray's own Engine at ZeRO ``extra['stage']``, in these plain processes: no Ray, no driver.

    The same engine, loss, optimizer and collective group (gloo) a zr<N> row's Ray actors run,
    stepped here the way the peers step torch. ``zr<N>/eng<N>`` in one run is what Ray adds to a
    step: the driver's call, the batch's trip, the actor's threads."""
    import zeroray as zr
    from bench_models import lm_loss
    from common import model_fn
    from zeroray.comm.group import make_torch_group
    from zeroray.engine.engine import Engine

    group = make_torch_group("gloo", rank, world_size, "127.0.0.1", port)
    base_rss = current_rss_bytes()
    engine = Engine(model_fn(spec), lm_loss, zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                    zr.ZeroConfig(stage=extra["stage"]), group, seed=spec.seed)
    try:
        out = _train(None, None, spec, rank, step_fn=lambda batch: engine.train_step(batch).loss,
                     gate=extra.get("gate"))
    finally:
        engine.close()
        group.close()
    return {**out, "base_rss_bytes": base_rss}


_ROWS = {"floor": run_floor, "apart": run_apart, "ddp": run_ddp, "ddp2": run_ddp, "fsdp2": run_fsdp2,
         "ds": run_deepspeed, "eng": run_engine}


def deepspeed_available() -> Optional[str]:
    """None when ``import deepspeed`` works, else why not (checked in a child: it is slow)."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if probe.returncode == 0:
        return None
    lines = (probe.stderr or "").strip().splitlines()
    return lines[-1] if lines else f"import deepspeed exited {probe.returncode}"
