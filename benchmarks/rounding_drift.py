"""How far float rounding alone moves the main job's training, in plain single-process PyTorch.

    python benchmarks/rounding_drift.py [--steps 150] [--adam-eps 1e-8] [--parts 6,5,5]

Trains examples/train_gpt.py's default model on its data, with its AdamW and clipping, twice:
once on the loss of the whole 16-row global batch, once on the same loss written as the
row-weighted mean of the parts (``--parts``: 6, 5 and 5 rows, as zeroray splits 16 rows over 3
workers). The two are equal in exact arithmetic and differ by rounding only; the script prints
their relative loss difference at every 10th step and the largest. It is the control for
tests/e2e/test_readme_commands.py, which compares the README's elastic pair (resumed at 3
workers) with one uninterrupted run at 2: any two orders of summation drift apart as far.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import gpt  # noqa: E402


def train(parts, batches, cfg, adam_eps):
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=adam_eps, weight_decay=0.0)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if parts is None:
            loss = gpt.gpt_loss(model, (x, y))
        else:
            loss = sum(gpt.gpt_loss(model, (a, b)) * (a.shape[0] / x.shape[0])
                       for a, b in zip(x.split(parts), y.split(parts)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--parts", default="6,5,5", help="rows of each part of the 16-row batch")
    args = p.parse_args()
    parts = [int(n) for n in args.parts.split(",")]
    if sum(parts) != 16:
        p.error(f"--parts {args.parts} must add up to the global batch, 16 rows")
    torch.set_num_threads(1)  # as a zeroray worker on this machine computes
    cfg = gpt.GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=4)
    batches = list(gpt.CharBatches(16, 128, args.steps, seed=0))
    whole, split = train(None, batches, cfg, args.adam_eps), train(parts, batches, cfg, args.adam_eps)
    rel = [abs(a - b) / a for a, b in zip(whole, split)]
    for step in [1, *range(10, args.steps + 1, 10)]:
        print(f"step {step}: whole {whole[step - 1]:.6f}, parts {split[step - 1]:.6f}, relative {rel[step - 1]:.1e}")
    worst = max(range(len(rel)), key=rel.__getitem__)
    tail = rel[min(119, len(rel) - 1):]
    print(f"largest: {rel[worst]:.1e} at step {worst + 1}; over steps 120-{args.steps}: {max(tail):.1e}")


if __name__ == "__main__":
    main()
