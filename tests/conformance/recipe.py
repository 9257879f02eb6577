"""What a fuzz case brings around its model (issue 41): the optimizer, torch.distributed in
``loss_fn``, SyncBatchNorm in the model (grammar.py's ``ModelSpec.sync_bn``), offload="disk".

The optimizers, each built the same way by the engine (a callable over its parameters, or
zeroray's own spec) and by the oracle (over the named trainable parameters, or the same torch
param groups):

  adamw         zr.AdamW (zeroray's own spec: the flat path), the fuzzer's first optimizer
  adam          torch.optim.Adam as a callable (the flat path: known element-wise)
  sgd_nesterov  torch.optim.SGD(momentum=0.9, nesterov=True, weight decay) as a callable (flat)
  adafactor     torch.optim.Adafactor (the whole-parameter path: factored matrices)
  muon          torch.optim.Muon on the 2-D hidden weights, AdamW on the rest, as one optimizer
                (tests/whole_param_optimizers.py's MuonAdamW; the whole-parameter path)
  lamb          a LAMB written in the test code (a per-tensor trust ratio; whole-parameter path)

Every denominator's epsilon is 1e-3 (Adam's, Adafactor's eps1, LAMB's, the AdamW beside Muon),
as compare.py explains for AdamW: a gradient that is exactly zero in exact arithmetic is
rounding noise, which a tiny epsilon turns into a real update of either sign. Parameter groups
(``RunConfig.groups``) scale the embedding's learning rate by half of the optimizer's own.

torch.optim.Muon's Newton-Schulz iteration runs in bf16, whose rounding turns the last-bit
difference of a gradient summed in another order into a difference of the update, so a muon
case is held to what the oracle shows against itself under reordering (compare.py), as
tests/dist/test_whole_param_optim.py holds torch's Muon on GPT-2.

``dist_loss``: ``loss_fn`` asks torch.distributed for its rank and world size and all-reduces
a detached copy of its loss, as user code written for DDP does, in a way that cannot change
the loss (the oracle, where torch.distributed is not initialised, skips the call).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict

import torch

from tests.whole_param_optimizers import Lamb, MuonAdamW

EPS = 1e-3
OPTIMIZERS = ("adamw", "adam", "sgd_nesterov", "adafactor", "muon", "lamb")
# the optimizers zeroray steps whole parameters with ([Note: optimizer paths] in engine/optim_choice.py)
WHOLE_PARAM = ("adafactor", "muon", "lamb")
# the ones whose bound is the oracle's own spread under reordering (compare.py's docstring)
REORDER_BOUND = ("muon", "lamb")
BASE_LR = {"adamw": 1e-2, "adam": 1e-2, "sgd_nesterov": 0.1, "adafactor": 1e-2, "muon": 0.02, "lamb": 1e-2}


def _adam(params, lr):
    return torch.optim.Adam(params, lr=lr, eps=EPS)


def _sgd_nesterov(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _adafactor(params, lr):
    return torch.optim.Adafactor(params, lr=lr, eps=(EPS, 1e-3))


def _muon(params, lr):
    return MuonAdamW(params, lr=lr, adamw_lr=lr / 2, adamw_eps=EPS)


def _lamb(params, lr):
    return Lamb(params, lr=lr, eps=EPS)


_BUILDERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": _adam, "sgd_nesterov": _sgd_nesterov, "adafactor": _adafactor, "muon": _muon, "lamb": _lamb}


def engine_optimizer(name: str, adamw: Dict[str, float]) -> Any:
    """What the engine is given: zr.AdamW(**adamw) for "adamw", else a callable over parameters."""
    import zeroray as zr

    if name == "adamw":
        return zr.AdamW(**adamw)
    return functools.partial(_BUILDERS[name], lr=lr_of(name, adamw))


def oracle_optimizer(name: str, params: Any, adamw: Dict[str, float]) -> torch.optim.Optimizer:
    """The same optimizer over single-process torch's named parameters or param groups."""
    if name == "adamw":
        return torch.optim.AdamW(params, **adamw)
    return _BUILDERS[name](params, lr=lr_of(name, adamw))


def lr_of(name: str, adamw: Dict[str, float]) -> float:
    """The optimizer's learning rate: AdamW's is the case's (configs.RunConfig.adamw); the others
    keep their own (bf16/fp16 cases are judged by the loss, whatever the optimizer)."""
    return adamw["lr"] if name == "adamw" else BASE_LR[name]


def dist_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` after the calls user code written for DDP makes: rank, world size, an all_reduce of
    a detached copy (the mean loss over ranks, as a metric would be). Returns ``loss`` unchanged
    in value: ``mean - mean`` is exactly zero for a finite mean, and a non-finite one is refused."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return loss
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= rank < world:
        raise RuntimeError(f"torch.distributed says rank {rank} of {world}")
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    if not torch.isfinite(mean):
        raise RuntimeError(f"the all-reduced loss is {mean.item()}")
    return loss + (mean - mean)
