"""What every part of benchmarks/gpu_check.py shares: the sizes of a run, the device, and the
batches (the real world-size-1 process group is tests/device_parity.py's ``world1_group``).

Two modes with the same code paths: the GPU run (CUDA, NCCL, the 808M GPT of the issue) and
``--smoke`` (CPU, gloo, a tiny GPT), which checks on any machine that the script itself works.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
for _path in (EXAMPLES, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import gpt  # noqa: E402


@dataclass(frozen=True)
class Setup:
    smoke: bool
    device: str             # "cuda:0" or "cpu"
    backend: str            # the world-1 process group: "nccl" or "gloo"
    timing_model: "gpt.GPTConfig"
    timing_batch: int
    warmup_steps: int
    timed_steps: int
    trainer_model: "gpt.GPTConfig"
    trainer_batch: int

    @classmethod
    def make(cls, smoke: bool) -> "Setup":
        if smoke:
            return cls(True, "cpu", "gloo", gpt.GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=64), 8, 1, 2,
                       gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32), 4)
        # The model: 808M parameters, batch 8 x 1024.
        return cls(False, "cuda:0", "nccl", gpt.GPTConfig(d_model=2048, n_layers=16, n_heads=16, seq_len=1024), 8,
                   3, 10, gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128), 8)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def describe(self) -> str:
        c = self.timing_model
        return (f"GPT d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, batch {self.timing_batch} x "
                f"{c.seq_len}, bf16")


def device_batches(setup: Setup, cfg: "gpt.GPTConfig", batch: int, steps: int, seed: int = 0):
    """Real-text batches, moved to the device once, outside any timed region."""
    return [tuple(t.to(setup.device) for t in b) for b in gpt.CharBatches(batch, cfg.seq_len, steps, seed=seed)]
