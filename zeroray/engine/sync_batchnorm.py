"""``nn.SyncBatchNorm`` on CPU workers: torch's math, with CPU kernels and gloo collectives.

[Note: SyncBatchNorm on CPU]
Under torch DDP, ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` makes every BatchNorm
normalise over the whole global batch: each rank's rows with the mean and variance of all
ranks' rows, which is single-process BatchNorm on the global batch. torch runs it on GPUs only:
once torch.distributed is initialised, its forward in training raises ``ValueError:
SyncBatchNorm expected input tensor to be on GPU`` for a CPU input, and its autograd function
(torch/nn/modules/_functions.py) uses CUDA kernels (``batch_norm_stats``,
``batch_norm_gather_stats_with_counts``, ``batch_norm_backward_elemt``). So torch DDP on CPU
cannot run a SyncBatchNorm model at all, and before torch.distributed existed on zeroray's
workers one quietly ran as a per-worker BatchNorm.

On CPU workers the engine runs each SyncBatchNorm module (one whose forward is torch's own: a
subclass with a forward of its own is left to it) through the same computation, written with
CPU tensor operations, over the module's ``process_group`` or the default group that zeroray
initialises for user code ([Note: torch.distributed in user code] in comm/user_group.py):

- forward, training: one all_reduce of each channel's sum and the row count gives the global
  mean; a second of each channel's summed squared deviation from it gives the biased variance
  (two passes, as CPU BatchNorm computes it, rather than a sum of squares); the output is
  ``(x - mean) * invstd * weight + bias``. Running statistics move as torch's SyncBatchNorm
  moves them: ``num_batches_tracked`` counts the call, momentum (or the cumulative average
  when it is None), the variance unbiased over the global count ``N / (N - 1)``;
- backward: the local ``sum(dy)`` and ``sum(dy * (x - mean))`` give the weight's and bias's
  gradients on this rank's rows (the engine averages them over ranks like every gradient, as
  DDP does); one all_reduce of the two sums gives the input's gradient,
  ``(dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * invstd * weight``. The sums
  run over every rank's loss, so each rank's input gradient is that of the sum of the ranks'
  losses, and with the engine's average over ranks the whole is the gradient of the global
  loss: single-process BatchNorm on the whole batch, as torch's own computes it;
- eval mode, a group of one, and torch.distributed not initialised: plain ``F.batch_norm``,
  as torch's forward falls back to it; an empty share of the batch still takes part in
  every collective (its sums are zero).

A rank's collectives depend only on the module calls and on whether the input needs a
gradient, the same on every rank, so they stay in one order across ranks as torch's do. A
peer inside the backward's all_reduce waits for this rank to reach it, so the gradient buckets
of such a model never wait in backward ([Note: no wait in backward] in comm/buckets.py). The
forward is swapped as an instance attribute (engine/forwards.py), before mixed precision wraps
the fp32 modules (a SyncBatchNorm is a ``_BatchNorm`` with running statistics: it computes in
fp32, its inputs cast in and its output cast back, [Note: mixed precision] in precision.py),
so the module's hooks, stage 3's gathers among them, run around it as around any forward.
GPU workers use torch's own SyncBatchNorm unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from zeroray.engine.forwards import own_forward, restorer


def install(model: torch.nn.Module, device: torch.device) -> Callable[[], None]:
    """Swap the forward of every SyncBatchNorm in ``model`` that runs torch's own for the CPU
    one (CPU engines only); returns what puts the forwards back."""
    originals = []
    if device.type == "cpu":
        for module in model.modules():
            if isinstance(module, torch.nn.SyncBatchNorm) and type(module).forward is torch.nn.SyncBatchNorm.forward \
                    and "forward" not in module.__dict__:
                originals.append(own_forward(module))
                module.forward = _cpu_forward(module, module.forward)
    return restorer(originals)


def synchronises(model: torch.nn.Module) -> bool:
    """Whether a SyncBatchNorm of ``model`` synchronises in training, on any device: then the
    model's backward issues collectives of its own (one all_reduce per module), and the gradient
    buckets never wait in backward ([Note: no wait in backward] in comm/buckets.py)."""
    return any(isinstance(m, torch.nn.SyncBatchNorm) and _sync_group(m) is not None for m in model.modules())


def _sync_group(module: torch.nn.SyncBatchNorm) -> Optional[Any]:
    """The group a training forward synchronises over; None where torch's forward would not
    synchronise (torch.distributed not initialised, or a group of one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = module.process_group or dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _cpu_forward(module: torch.nn.SyncBatchNorm, original: Callable) -> Callable:
    """torch's ``SyncBatchNorm.forward`` (torch/nn/modules/batchnorm.py), step for step, with
    the synchronised case on CPU; see [Note: SyncBatchNorm on CPU]."""

    def forward(input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu":
            return original(input)
        m = module
        m._check_input_dim(input)
        m._check_non_zero_input_channels(input)
        factor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats:
            m.num_batches_tracked.add_(1)
            factor = 1.0 / m.num_batches_tracked.item() if m.momentum is None else m.momentum
        bn_training = m.training or (m.running_mean is None and m.running_var is None)
        running_mean = m.running_mean if not m.training or m.track_running_stats else None
        running_var = m.running_var if not m.training or m.track_running_stats else None
        group = _sync_group(m) if bn_training and m.training else None
        if group is None:
            return F.batch_norm(input, running_mean, running_var, m.weight, m.bias, bn_training, factor, m.eps)
        return SyncBatchNormCPU.apply(input, m.weight, m.bias, running_mean, running_var, m.eps, factor, group)

    forward.__name__ = forward.__qualname__ = "sync_batchnorm_cpu_forward"
    return forward


def _dims(x: torch.Tensor) -> Tuple[List[int], List[int]]:
    """(the dimensions reduced per channel, the shape a per-channel vector broadcasts in)."""
    reduce = [0] + list(range(2, x.dim()))
    return reduce, [1, x.shape[1]] + [1] * (x.dim() - 2)


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class SyncBatchNormCPU(torch.autograd.Function):
    """Training-mode batch normalisation over every rank's rows of ``group``; see [Note:
    SyncBatchNorm on CPU]. Arguments as torch's ``sync_batch_norm`` function, less world size."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float,
                momentum: float, group: Any) -> torch.Tensor:
        reduce, shape = _dims(input)
        channels = input.shape[1]
        count = input.numel() // channels if input.numel() else 0
        local = torch.empty(channels + 1, dtype=input.dtype)
        local[:channels] = input.sum(reduce) if count else 0
        local[channels] = count
        total = _all_reduce(local, group)
        n = total[channels].item()
        mean = total[:channels] / n
        xmu = input - mean.view(shape)
        var = _all_reduce((xmu * xmu).sum(reduce) if count else torch.zeros_like(mean), group) / n
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.group, ctx.count = group, n
        scale = invstd if weight is None else invstd * weight
        out = xmu * scale.view(shape)
        return out if bias is None else out + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        reduce, shape = _dims(input)
        xmu = input - mean.view(shape)
        sum_dy = grad_output.sum(reduce)
        sum_dy_xmu = (grad_output * xmu).sum(reduce)
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            channels = sum_dy.numel()
            total = _all_reduce(torch.cat([sum_dy, sum_dy_xmu]), ctx.group)
            mean_dy, mean_dy_xmu = total[:channels] / ctx.count, total[channels:] / ctx.count
            scale = invstd if weight is None else invstd * weight
            grad_input = (grad_output - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) \
                * scale.view(shape)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
