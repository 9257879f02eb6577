"""What one training step returns, and the checks of its loss and gradient norm that fail it.

A non-finite loss is not raised where it is computed: its gradients turn non-finite, every
rank sees the non-finite global norm after the status all-reduce, and all raise together
(fp32/bf16) or skip the step (fp16, whose loss scaler backs off).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from zeroray.errors import StepError


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    step: int
    skipped: bool
    loss_scale: Optional[float]
    time_s: float


def check_loss(loss: Any, step: int) -> None:
    """``loss_fn``'s result must be a scalar tensor that autograd can differentiate."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise StepError(f"step {step}: loss_fn must return a scalar tensor (the mean loss over the "
                        f"batch), got {shape}; reduce it with .mean()")
    if not loss.requires_grad:
        raise StepError(f"step {step}: the loss does not require grad: loss_fn must compute it "
                        "from the model's output (did it run under torch.no_grad()?)")


def skips(norm: float, loss: float, step: int, rank: int, scaled: bool) -> bool:
    """Whether the step is skipped for a non-finite global gradient ``norm``: with a loss
    scaler (``scaled``, fp16) it is; without one the step raises, saying whether this rank's
    ``loss`` was the cause."""
    if math.isfinite(norm):
        return False
    if scaled:
        return True
    if not math.isfinite(loss):
        raise StepError(f"step {step}: loss_fn returned a non-finite loss ({loss}) on "
                        f"worker {rank}, so the gradients are not finite and the step was not "
                        "applied. Check the batch and the model for inf/nan (log of 0, division by 0, "
                        "overflow) or lower the learning rate.")
    raise StepError(f"step {step}: the gradient norm is not finite (this worker's loss "
                    f"was {loss}). Lower the learning rate, clip gradients (max_grad_norm) "
                    "or check the data for inf/nan.")
