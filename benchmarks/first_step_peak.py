"""Peak RSS after each step of one engine in this process (SoloGroup, no Ray): whether the first
update costs more memory than the steps after it (benchmarks/README.md, "The first update's re-homing").

    PYTHONPATH=. python benchmarks/first_step_peak.py            # stage 0, examples/gpt.py at 101M
    PYTHONPATH=. python benchmarks/first_step_peak.py --stage 3
"""
import argparse
import functools
import resource

import torch

import zeroray as zr
from examples import gpt
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=256, seq_len=64, n_layers=args.layers, n_heads=8, d_model=args.d_model)
    engine = Engine(functools.partial(gpt.GPT, cfg), gpt.gpt_loss, zr.AdamW(lr=1e-3),
                    zr.ZeroConfig(stage=args.stage), SoloGroup(), seed=0)
    x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    print(f"stage {args.stage}, after construction: {rss_mb():.0f} MB")
    for i in range(args.steps):
        engine.train_step((x[:, :-1], x[:, 1:]))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux
        print(f"step {i + 1}: peak so far {peak:.0f} MB, now {rss_mb():.0f} MB", flush=True)


if __name__ == "__main__":
    main()
