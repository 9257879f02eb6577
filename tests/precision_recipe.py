"""PyTorch's own mixed-precision recipe, in plain single-process PyTorch and over gloo ranks: the
reference that tests/dist/test_precision_vs_pytorch.py holds zeroray's bf16 and fp16 training
against.

The recipe is the classic one, which is also what FSDP's
``MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)`` computes:
- the fp32 model is built (``torch.manual_seed(seed); model_fn()``) and an fp32 *master* copy of
  every trainable parameter taken from it;
- the model is lowered to the compute dtype the way its rule's PyTorch users do it
  (``LOWERINGS``: ``model.to(dtype)``; that plus FSDP's own fp32 override of ``_BatchNorm``;
  Hugging Face's ``from_pretrained(dtype=...)``);
- each step runs forward and backward on the lowered model (fp16: the loss scaled by torch's
  ``GradScaler``), casts each gradient to fp32 and averages it over the ranks in fp32 (an
  all-reduce over gloo when ``world > 1``; a parameter no rank used keeps ``.grad`` None and
  the optimizer skips it), steps the torch optimizer on the master (fp16: ``GradScaler.step``,
  which unscales, skips a step whose gradients hold inf/nan, and ``update`` moves the scale),
  and copies the master back into the lowered model.

``stored_low=True`` makes the reference take zeroray's one deliberate difference from the recipe
([Note: mixed precision] in zeroray/engine/precision.py), so that a test can tell it from
everything else: the fp32-kept modules' trainable weights stored in the compute dtype and
widened for the call (their gradient then passes through the compute dtype too).
"""
from __future__ import annotations

import datetime
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from zeroray.engine.batch import split_batch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def lower_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)``: parameters, frozen ones included, and floating buffers."""
    return model.to(dtype)


def lower_fsdp_batchnorm(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` but every ``_BatchNorm`` in fp32 with FSDP's own hooks (FSDP's
    ``MixedPrecision._module_classes_to_ignore`` default): inputs cast to fp32, outputs back to
    the input's dtype, parameters, gradients and running statistics fp32."""
    from torch.distributed.fsdp._common_utils import _override_module_mixed_precision

    model.to(dtype)
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.float()
    _override_module_mixed_precision(model, (_BatchNorm,))
    return model


def lower_hf_pretrained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What ``from_pretrained(path, dtype=dtype)`` loads for the saved fp32 ``model``: the keep-in-
    fp32 modules and the rotary ``inv_freq`` in fp32, everything else in ``dtype``."""
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        return type(model).from_pretrained(path, dtype=dtype)


LOWERINGS: Dict[str, Callable[[nn.Module, torch.dtype], nn.Module]] = {
    "to": lower_to, "fsdp-batchnorm": lower_fsdp_batchnorm, "hf-pretrained": lower_hf_pretrained}


def _fp32_modules(model: nn.Module) -> List[nn.Module]:
    """The modules whose floating parameters the lowering left in fp32 (outermost only)."""
    out: List[nn.Module] = []
    inside = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if own and all(p.dtype == torch.float32 for p in own):
            out.append(module)
            inside.update(id(m) for m in module.modules())
    return out


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cast_floats(v, dtype) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


def store_low(model: nn.Module, dtype: torch.dtype) -> None:
    """``stored_low``: each fp32 module's trainable parameters stored in ``dtype`` and widened (a
    differentiable ``.float()``) for its forward, its floating inputs cast to fp32 (the model's
    own code no longer sees an fp32 weight to cast them to)."""
    for module in _fp32_modules(model):
        owned = [(owner, name) for owner in module.modules()
                 for name, p in owner._parameters.items() if p is not None and p.requires_grad]
        for owner, name in owned:
            owner._parameters[name] = nn.Parameter(owner._parameters[name].detach().to(dtype))
        original = module.forward

        def forward(*args, _owned=owned, _original=original, **kwargs):
            args = _cast_floats(args, torch.float32)
            kwargs = {k: _cast_floats(v, torch.float32) for k, v in kwargs.items()}
            stored = [owner._parameters[name] for owner, name in _owned]
            for (owner, name), p in zip(_owned, stored):
                owner._parameters[name] = p.float()
            try:
                return _original(*args, **kwargs)
            finally:
                for (owner, name), p in zip(_owned, stored):
                    owner._parameters[name] = p
        module.forward = forward


def build(model_fn: Callable[[], nn.Module], dtype: str, lowering: str = "to", *, seed: int = 0,
          stored_low: bool = False) -> Tuple[Dict[str, torch.Tensor], nn.Module, Dict[str, torch.dtype]]:
    """(the fp32 master by parameter name, the lowered model, the dtype the lowering gave each of
    its parameters and buffers). Before any process group exists: Hugging Face saves on rank 0
    only once one does."""
    compute = DTYPES[dtype]
    torch.manual_seed(seed)
    model = model_fn()
    master = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters() if p.requires_grad}
    model = LOWERINGS[lowering](model, compute)
    lowered = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}
    if stored_low:
        store_low(model, compute)
    return master, model, lowered


def train(model_fn: Callable[[], nn.Module], loss_fn: Callable, batches: List[Any], dtype: str,
          lowering: str = "to", *, seed: int = 0, lr: float = 1e-2, scaler: Optional[dict] = None,
          stored_low: bool = False, reverse_rows: bool = False, fused: bool = False, world: int = 1,
          rank: int = 0, built=None) -> Dict[str, Any]:
    """The recipe on ``batches`` (global batches; with ``world > 1`` this rank's share of each, in a
    default process group that is already initialised, and ``built`` from ``build``).

    Two ways to change only the float arithmetic's order: ``reverse_rows``, each rank's share in
    reverse row order (every mean and sum over rows is the same in exact arithmetic); ``fused``,
    torch's fused AdamW kernel instead of its default one (the same update, computed in another
    order; under fp16 ``GradScaler`` then hands the kernel the scale to unscale by).

    Returns the global loss and the fp32 master after every step, the loss scale after each step
    and whether it was skipped (fp16), the final buffers, and ``lowered`` (``build``'s dtypes)."""
    master, model, lowered = built or build(model_fn, dtype, lowering, seed=seed, stored_low=stored_low)
    params = dict(model.named_parameters())
    assert set(params) >= set(master), f"the lowering renamed parameters: {sorted(set(master) - set(params))}"
    opt = torch.optim.AdamW(list(master.values()), lr=lr, fused=fused)
    grad_scaler = torch.amp.GradScaler("cpu", **scaler) if dtype == "fp16" else None
    if world > 1:
        import torch.distributed as dist
    out: Dict[str, Any] = {"losses": [], "masters": [], "scales": [], "skipped": [], "lowered": lowered}
    for batch in batches:
        share = split_batch(batch, world)[rank] if world > 1 else batch
        if reverse_rows:
            share = _reversed(share)
        loss = loss_fn(model, share)
        (grad_scaler.scale(loss) if grad_scaler else loss).backward()
        grads = [params[n].grad for n in master]
        loss_value = torch.tensor([loss.item()], dtype=torch.float64)
        used = torch.tensor([g is not None for g in grads], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(used)
            dist.all_reduce(loss_value)
            loss_value /= world
        reduced: List[Optional[torch.Tensor]] = []
        for m, g, u in zip(master.values(), grads, used.tolist()):
            if not u:  # no rank used it: .grad stays None and the optimizer skips it
                reduced.append(None)
                continue
            g = g.float() if g is not None else torch.zeros_like(m)  # the reduce dtype: fp32
            if world > 1:
                dist.all_reduce(g)
                g /= world
            reduced.append(g)
        for m, g in zip(master.values(), reduced):
            m.grad = g
        if grad_scaler:
            before = grad_scaler.get_scale()
            grad_scaler.step(opt)
            grad_scaler.update()
            out["scales"].append(grad_scaler.get_scale())
            out["skipped"].append(grad_scaler.get_scale() < before)
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, m in master.items():
                params[n].copy_(m)
        out["losses"].append(loss_value.item())
        out["masters"].append({n: m.detach().clone() for n, m in master.items()})
    out["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
    return out


def _reversed(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.flip(0)
    if isinstance(batch, dict):
        return {k: _reversed(v) for k, v in batch.items()}
    return type(batch)(_reversed(v) for v in batch)


def _run_in_group(rank: int, world: int, port: int, spec: dict) -> Dict[str, Any]:
    """The harness's ``runner`` (tests/dist/harness.py): ``train`` on this rank, in a gloo default
    process group of its own."""
    import torch.distributed as dist

    recipe = spec["recipe"]
    built = build(recipe["model_fn"], recipe["dtype"], recipe.get("lowering", "to"), seed=recipe.get("seed", 0),
                  stored_low=recipe.get("stored_low", False))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        return train(**recipe, world=world, rank=rank, built=built)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def distributed(**recipe) -> dict:
    """A harness spec that trains ``recipe`` (``train``'s keyword arguments) on the harness's
    ranks: pass it to ``run_engines`` beside engine specs; every rank returns the same losses and
    masters, and its own buffers (rank 0's are DDP's)."""
    return {"runner": _run_in_group, "recipe": recipe}
