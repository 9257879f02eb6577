"""Micro-batches of one worker that take different branches (found by the fuzzer, issue 24).

One worker, two micro-batches per step (grad_accum_steps=2); the first runs module ``b``,
the second module ``a`` (tests.models.DivergentNet routes on the first token), and in the
flipped variant the order changes every other step. Every module is used in every step, so
PyTorch's result is unambiguous: the mean of the two micro-batches' losses.

Before the fixes:
- stages 0-1 lost ``b``'s gradient: autograd accumulates full gradients until the last
  micro-batch and the buckets take them from the post-accumulate hook, which does not fire
  for a parameter the last micro-batch does not use; its ``.grad`` then stayed set and was
  added into the next step's (loss off by 1e-3..1e-2 from step 1, parameters by 4e-2). Fixed
  by GradIntake.reduce_accumulated;
- stage 3 on one worker raised UnrecoverableDivergence ("worker 0 left the step's prefetch
  plan ... over NCCL the workers cannot negotiate"): SoloGroup said its channels were not
  independent, which is about NCCL's single stream, not about a group of one.
"""
import pytest
import torch

import zeroray as zr
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from tests.models import divergent_model, lm_loss, make_batches, per_shard_loss, reference_run

ADAMW = dict(lr=1e-2, weight_decay=0.1)


def branch_batches(steps: int, flip: bool):
    """4 rows per step: micro-batch 0 (rows 0-1) routes to ``b`` (odd token), 1 to ``a``; flipped
    on odd steps with ``flip``."""
    out = []
    for step, (idx, tgt) in enumerate(make_batches(steps, batch=4)):
        idx = idx.clone()
        idx[0, 0], idx[2, 0] = (2, 1) if flip and step % 2 else (1, 2)
        out.append((idx, tgt))
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("flip", [False, True])
def test_micro_batches_taking_different_branches_match_pytorch(stage, flip):
    batches = branch_batches(4, flip)
    engine = Engine(divergent_model, lm_loss, zr.AdamW(**ADAMW), zr.ZeroConfig(stage=stage, grad_accum_steps=2),
                    SoloGroup())
    losses = [engine.train_step(b).loss for b in batches]
    ref_losses, _, ref_state = reference_run(divergent_model, per_shard_loss(lm_loss, 2),
                                             lambda m: torch.optim.AdamW(m.parameters(), **ADAMW), batches)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs reference {b}"
    for name in engine.layout.param_names:
        err = (engine.master_piece(name)[2] - ref_state[name].reshape(-1)).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs diff {err}"
    engine.close()
