"""Peak RSS after each step of one engine in this process (SoloGroup, no Ray): whether the first
update costs more memory than the steps after it (benchmarks/README.md, "The first update's re-homing").

    PYTHONPATH=. python benchmarks/first_step_peak.py            # stage 0, examples/gpt.py at 101M
    PYTHONPATH=. python benchmarks/first_step_peak.py --stage 3
"""
import argparse
import functools

import torch

import zeroray as zr
from common import current_rss_bytes, peak_rss_bytes
from examples import gpt
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine


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
    print(f"stage {args.stage}, after construction: {current_rss_bytes() / 1e6:.0f} MB")
    for i in range(args.steps):
        engine.train_step((x[:, :-1], x[:, 1:]))
        print(f"step {i + 1}: peak so far {peak_rss_bytes() / 1e6:.0f} MB, now {current_rss_bytes() / 1e6:.0f} MB",
              flush=True)


if __name__ == "__main__":
    main()
