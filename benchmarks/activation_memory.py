"""Activation bytes with and without activation checkpointing (ZeRO-R P_a), for the main job's model.

    python benchmarks/activation_memory.py            # GPT d_model 256, 4 layers, seq 128, 8 sequences/worker
    python benchmarks/activation_memory.py --d-model 512 --layers 8

One worker's engine (world size 1, in this process) trains a few steps per configuration.
"measured" is ``engine.activation_peak_bytes``: the bytes of distinct storages autograd saved
during the forward (parameters excluded) plus the inputs kept by checkpointed blocks, at the
end of the forward ([Note: saved-tensor bytes] in zeroray/engine/activations.py). It does not
include the one block that backward recomputes at a time; that working set is measured
separately below (one block's saved bytes), and the estimate includes it.
"estimate" is ``zeroray.memory.model.activation_bytes`` (Korthikanti et al.'s per-layer count,
doubled for fp32), with the s x s attention term (``heads``) and without it (fused attention,
which is what torch's CPU ``scaled_dot_product_attention`` runs). It counts the transformer
layers only: embeddings and the output layer's logits are not in it. MB = 1e6 bytes.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import zeroray as zr  # noqa: E402
from examples import gpt  # noqa: E402
from zeroray.memory import model as memory  # noqa: E402
from zeroray.comm.group import SoloGroup  # noqa: E402
from zeroray.engine.engine import Engine  # noqa: E402

CONFIGS = [
    ("none", dict()),
    ("blocks", dict(activation_checkpointing=(gpt.Block,))),
    ("blocks + offload", dict(activation_checkpointing=(gpt.Block,), offload_activations=True)),
]


def run(cfg, batch, steps, stage, zero):
    engine = Engine(functools.partial(gpt.GPT, cfg), gpt.gpt_loss, zr.AdamW(lr=1e-3),
                    zr.ZeroConfig(stage=stage, **zero), SoloGroup())
    times, losses = [], []
    for b in gpt.CharBatches(batch, cfg.seq_len, steps, seed=0):
        t0 = time.perf_counter()
        losses.append(engine.train_step(b).loss)
        times.append(time.perf_counter() - t0)
    peak = engine.activation_peak_bytes
    engine.close()
    return peak, statistics.median(times[1:] or times), losses


def one_block_bytes(cfg, batch):
    """Bytes autograd saves for one block's forward (its own parameters excluded)."""
    block = gpt.Block(cfg)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per worker")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", default="0,3")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    shape = dict(layers=cfg.n_layers, hidden=cfg.d_model, seq_len=cfg.seq_len, batch=args.batch, dtype="fp32")
    print(f"GPT d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, seq {cfg.seq_len}, "
          f"{args.batch} sequences per worker, fp32; MB = 1e6 B\n")
    block = one_block_bytes(cfg, args.batch)
    print(f"{'stage':>5} {'checkpointing':18} {'measured MB':>12} {'estimate MB':>12} {'est. fused MB':>14} "
          f"{'s/step':>7}  final loss")
    baseline = {}
    for stage in (int(s) for s in args.stages.split(",")):
        for name, zero in CONFIGS:
            peak, step_s, losses = run(cfg, args.batch, args.steps, stage, zero)
            ckpt = bool(zero.get("activation_checkpointing"))
            offload = bool(zero.get("offload_activations"))
            est = memory.activation_bytes(heads=cfg.n_heads, checkpointing=ckpt, offload=offload, **shape)
            fused = memory.activation_bytes(checkpointing=ckpt, offload=offload, **shape)
            baseline.setdefault(stage, peak)
            print(f"{stage:>5} {name:18} {peak / 1e6:12.2f} {est / 1e6:12.2f} {fused / 1e6:14.2f} "
                  f"{step_s:7.3f}  {losses[-1]:.6f}  ({peak / baseline[stage]:.0%} of none)")
    print(f"\none block's saved activations (the working set backward recomputes, not in 'measured'): "
          f"{block / 1e6:.2f} MB; estimate per layer {memory.activation_bytes(heads=cfg.n_heads, **{**shape, 'layers': 1}) / 1e6:.2f} MB "
          f"(fused {memory.activation_bytes(**{**shape, 'layers': 1}) / 1e6:.2f} MB)")
    print("on CPU, offload_activations keeps the checkpoints where they already are (host memory): same bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
