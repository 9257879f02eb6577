"""GPU check, on one CUDA device, in a few minutes (issue: GPU path).

    python benchmarks/gpu_check.py            # parity, bf16 step time, peak memory; exit 1 if parity fails
    python benchmarks/gpu_check.py --quick    # smaller model for the timing part

1. Parity of ZeRO stages 0-3 with one worker against plain PyTorch on CUDA (fp32, AdamW,
   the tests' awkward model: tied weights, a module called twice, frozen parameter, buffer).
2. bf16 step time of the main job's GPT at a size that keeps the GPU busy (d_model 2048,
   16 layers) under zeroray's engine (stage 3, world 1: all hooks, buckets, the coordinator)
   vs plain PyTorch bf16 autocast-free training of the same model on the same GPU; the
   ratio is zeroray's overhead.
3. Peak GPU memory (torch.cuda.max_memory_allocated) vs zeroray.estimate_memory.

World size 1 uses no process group, so this needs neither Ray nor NCCL; the NCCL path of
multi-GPU runs goes through the same TorchGroup code with backend "nccl".
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt  # noqa: E402

import zeroray as zr  # noqa: E402
from zeroray.comm.group import SoloGroup  # noqa: E402
from zeroray.engine import Engine  # noqa: E402


def parity(device: str) -> bool:
    from tests.models import lm_loss, make_batches, parity_model

    batches = [tuple(t.to(device) for t in b) for b in make_batches(6)]
    torch.manual_seed(0)
    ref = parity_model().to(device)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for b in batches:
        opt.zero_grad()
        loss = lm_loss(ref, b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ok = True
    for stage in range(4):
        engine = Engine(parity_model, lm_loss, zr.AdamW(lr=1e-2, weight_decay=0.1), zr.ZeroConfig(stage=stage),
                        SoloGroup(), device=device)
        losses = [engine.train_step(b).loss for b in batches]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_err = 0.0
        for name, p in ref.named_parameters():
            if name in engine.layout.slots:
                lo, hi, piece = engine.master_piece(name)
                param_err = max(param_err, (piece - p.detach().reshape(-1)[lo:hi].cpu()).abs().max().item())
        good = loss_err <= 1e-5 and param_err <= 1e-5
        ok &= good
        print(f"parity stage {stage}: max rel loss diff {loss_err:.2e}, max abs param diff {param_err:.2e} "
              f"{'OK' if good else 'FAIL'}", flush=True)
        engine.close()
    return ok


def timing(device: str, d_model: int, layers: int, steps: int) -> None:
    cfg = gpt.GPTConfig(d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 128), seq_len=1024)
    batches = [tuple(t.to(device) for t in b) for b in gpt.CharBatches(8, cfg.seq_len, steps + 3)]
    n_params = sum(p.numel() for p in gpt.GPT(gpt.GPTConfig(**{**cfg.__dict__})).parameters())

    def timed(step_fn):
        for b in batches[:3]:
            step_fn(b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches[3:]:
            step_fn(b)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = gpt.GPT(cfg).to(device=device, dtype=torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-4)

    def plain_step(b):  # the same mixed-precision recipe by hand: bf16 compute, fp32 master + Adam
        for p in model.parameters():
            p.grad = None
        gpt.gpt_loss(model, b).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)

    plain_s = timed(plain_step)
    plain_peak = torch.cuda.max_memory_allocated()
    del model, master, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(lambda: gpt.GPT(cfg), gpt.gpt_loss, zr.AdamW(lr=1e-4), zr.ZeroConfig(stage=3, dtype="bf16"),
                    SoloGroup(), device=device)
    zr_s = timed(lambda b: engine.train_step(b))
    zr_peak = torch.cuda.max_memory_allocated()
    est = zr.estimate_memory(n_params, 1, 3, dtype="bf16")
    tokens = 8 * cfg.seq_len
    print(f"model: {n_params / 1e6:.0f}M params, d_model {d_model}, {layers} layers, batch 8 x {cfg.seq_len}, bf16")
    print(f"{'run':<16}{'s/step':>10}{'tokens/s':>12}{'peak GiB':>10}")
    print(f"{'plain PyTorch':<16}{plain_s:>10.4f}{tokens / plain_s:>12.0f}{plain_peak / 2**30:>10.2f}")
    print(f"{'zeroray stage 3':<16}{zr_s:>10.4f}{tokens / zr_s:>12.0f}{zr_peak / 2**30:>10.2f}")
    print(f"zeroray / plain step time: {zr_s / plain_s:.3f}")
    print(f"model-state estimate (paper, 1 worker, bf16 mixed): {est / 2**30:.2f} GiB; measured peak includes "
          f"activations, so peak - estimate = {(zr_peak - est) / 2**30:.2f} GiB of activations and buffers")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run this on a GPU machine)")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    ok = parity("cuda")
    d, layers = (1024, 8) if args.quick else (2048, 16)
    timing("cuda", d, layers, args.steps)
    print(f"total {time.perf_counter() - t0:.0f}s; parity {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
