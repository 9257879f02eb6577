"""The measuring parts of benchmarks/gpu_check.py: step time, peak memory, memory after close.

``timing`` runs, in one process, plain PyTorch and then zeroray stages 0-3 on the same model
and batches (bf16), the engines through one kind of group: ``solo`` (the SoloGroup shortcut
of world size 1) or the real world-1 process group (NCCL; gloo in --smoke). For each engine:
seconds per step, its own peak memory, the model-state bytes it holds next to the paper's
estimate, and the memory it leaves behind after ``close()``.

[Note: the plain PyTorch row]
The same mixed-precision recipe as zeroray's bf16 by hand: bf16 parameters compute, their
gradients are cast into fp32 master weights, fused AdamW updates the masters, and the bf16
parameters are copied back. It is the floor an engine's overhead is measured against.

[Note: memory after close]
On CUDA, ``torch.cuda.memory_allocated`` before the engine is built against after
``close()``, ``del`` and ``gc.collect()``; on the CPU (--smoke) the bytes of every live tensor
storage (a gc census) and whether the engine object itself is still alive. Anything above
``LEAK_TOLERANCE`` fails the part: an Engine that was closed must give back what it held.

``fsdp2`` is the peer on the same device: torch FSDP2 at world size 1 through the same
backend, ``fully_shard`` on each block and the root, bf16 parameters, fp32 reduction.
"""
from __future__ import annotations

import gc
import time
import weakref
from typing import Callable, Dict, List

import torch

from benchmarks.gpu_setup import Setup, device_batches
import gpt  # examples/gpt.py, on sys.path through gpu_setup

import zeroray as zr
from tests.device_parity import world1_group
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine

GiB = 2**30
LEAK_TOLERANCE = 256 * 2**20  # bytes; the leak this guards against was 13.6 GiB per engine
LR = 1e-4


def _allocated(setup: Setup) -> int:
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    from zeroray.memory.report import live_tensor_bytes

    return live_tensor_bytes()


def _timed(setup: Setup, step: Callable, batches) -> float:
    """Mean seconds per step over the timed steps, after the warm-up ones (synchronised)."""
    for b in batches[:setup.warmup_steps]:
        step(b)
    setup.sync()
    t0 = time.perf_counter()
    for b in batches[setup.warmup_steps:]:
        step(b)
    setup.sync()
    return (time.perf_counter() - t0) / setup.timed_steps


def _peak_since(setup: Setup, before: int):
    return torch.cuda.max_memory_allocated() - before if setup.cuda else None


def _reset_peak(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats()


def plain_run(setup: Setup, batches) -> Dict[str, float]:
    """See [Note: the plain PyTorch row]."""
    before = _allocated(setup)
    _reset_peak(setup)
    torch.manual_seed(0)
    model = gpt.GPT(setup.timing_model).to(device=setup.device, dtype=torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(master, lr=LR, fused=True)

    def step(b) -> None:
        gpt.gpt_loss(model, b).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)

    s = _timed(setup, step, batches)
    peak = _peak_since(setup, before)
    del model, params, master, opt, step
    return {"s_per_step": s, "peak_bytes": peak, "num_params": gpt.num_params(setup.timing_model)}


def engine_run(setup: Setup, stage: int, via: str, batches) -> Dict[str, object]:
    from zeroray.memory.report import measure

    before = _allocated(setup)
    _reset_peak(setup)
    group = SoloGroup() if via == "solo" else world1_group(setup.backend)
    engine = Engine(lambda: gpt.GPT(setup.timing_model), gpt.gpt_loss, zr.AdamW(lr=LR),
                    zr.ZeroConfig(stage=stage, dtype="bf16"), group, device=setup.device)
    s = _timed(setup, engine.train_step, batches)
    peak = _peak_since(setup, before)
    report = measure(engine)
    engine.close()
    group.close()
    alive = weakref.ref(engine)
    del engine, group
    left = _allocated(setup) - before
    return {"s_per_step": s, "peak_bytes": peak, "model_state_bytes": report["measured"]["total"],
            "estimate_bytes": report["estimate"]["total"],
            "paper_bytes": zr.estimate_memory(report["num_params"], 1, stage, dtype="bf16"),
            "left_after_close_bytes": left, "engine_alive_after_close": alive() is not None}


def _mem(setup: Setup, b) -> str:
    """GiB on the GPU; MiB for the tiny models of --smoke."""
    return "n/a" if b is None else f"{b / (2**20 if setup.smoke else GiB):.2f}"


def timing_part(setup: Setup, via: str) -> dict:
    batches = device_batches(setup, setup.timing_model, setup.timing_batch, setup.warmup_steps + setup.timed_steps)
    tokens = setup.timing_batch * setup.timing_model.seq_len
    plain = plain_run(setup, batches)
    label = "solo" if via == "solo" else f"{setup.backend} world 1"
    print(f"timing through {label}: {plain['num_params'] / 1e6:.0f}M params, {setup.describe()}, "
          f"{setup.timed_steps} steps after {setup.warmup_steps}", flush=True)
    unit = "MiB" if setup.smoke else "GiB"
    print(f"{'run':<18}{'s/step':>9}{'x plain':>9}{'tokens/s':>11}{'peak ' + unit:>10}{'state ' + unit:>10}"
          f"{'est ' + unit:>9}{'left after close':>18}", flush=True)
    print(f"{'plain PyTorch':<18}{plain['s_per_step']:>9.4f}{1.0:>9.3f}{tokens / plain['s_per_step']:>11.0f}"
          f"{_mem(setup, plain['peak_bytes']):>10}", flush=True)
    runs: Dict[str, dict] = {}
    failures: List[str] = []
    for stage in range(4):
        r = engine_run(setup, stage, via, batches)
        r["ratio"] = r["s_per_step"] / plain["s_per_step"]
        runs[f"stage{stage}"] = r
        leak = r["left_after_close_bytes"] > LEAK_TOLERANCE or r["engine_alive_after_close"]
        left = f"{r['left_after_close_bytes'] / 2**20:.0f} MiB{' (alive)' if r['engine_alive_after_close'] else ''}"
        print(f"{'zeroray stage ' + str(stage):<18}{r['s_per_step']:>9.4f}{r['ratio']:>9.3f}"
              f"{tokens / r['s_per_step']:>11.0f}{_mem(setup, r['peak_bytes']):>10}"
              f"{_mem(setup, r['model_state_bytes']):>10}{_mem(setup, r['estimate_bytes']):>9}{left:>18}"
              f"{' FAIL' if leak else ''}", flush=True)
        if leak:
            failures.append(f"memory after close ({label}, stage {stage}): {left} left")
    print("state = model-state bytes the engine holds (measured), est = zeroray's estimate of them; "
          "peak - state is activations, buckets and workspace", flush=True)
    return {"failures": failures, "via": via, "plain": plain, "runs": runs}


def fsdp2_part(setup: Setup) -> dict:
    """The peer figure: FSDP2 at world size 1 through the same backend as the world-1 group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeroray.comm.port import free_port

    if setup.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(setup.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        batches = device_batches(setup, setup.timing_model, setup.timing_batch,
                                 setup.warmup_steps + setup.timed_steps)
        before = _allocated(setup)
        _reset_peak(setup)
        torch.manual_seed(0)
        model = gpt.GPT(setup.timing_model).to(setup.device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(b) -> None:
            gpt.gpt_loss(model, b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        s = _timed(setup, step, batches)
        peak = _peak_since(setup, before)
    finally:
        dist.destroy_process_group()
    unit = "MiB" if setup.smoke else "GiB"
    print(f"FSDP2 world 1 ({setup.backend}), bf16 params / fp32 reduce: {s:.4f} s/step, "
          f"peak {_mem(setup, peak)} {unit}", flush=True)
    return {"failures": [], "s_per_step": s, "peak_bytes": peak}
