"""Sharded construction for stage 3: the full model never exists on one worker.

[Note: sharded construction]
The approach of DeepSpeed's ``zero.Init``: intercept construction, and as soon as a module's
``__init__`` returns, keep only this rank's slice of its parameters and free the rest, so
the peak during construction is about the rank's shard plus the largest module.

Which slice to keep depends on where each parameter ends up in the *final* model (its unit
and offset in the flat layout, whether a parent later ties or freezes it), which is not
known while the model is half built. So construction runs twice:
1. on the ``meta`` device (no memory, no random numbers drawn): the final structure, hence
   the FlatLayout and each parameter's fate;
2. for real, after ``torch.manual_seed(seed)``: parameters are matched to their fate by
   creation order (the same in both passes), and partitioned when their module is built.
Trainable parameters keep the rank's range of their unit; frozen ones stay whole (they are
replicated); parameters a parent replaces later (the untied weight of a tied layer) are
dropped. Random numbers are drawn exactly as in ``torch.manual_seed(seed); model_fn()``.

A parent that *writes* a child's parameters after the child was built (``self.apply(init)``
at the end of ``__init__``) would write into freed memory, and its values would be lost. So
while construction runs, a freed parameter is a *placeholder*: its right shape, expanded
(stride 0) from one element of a canary tensor. An initialiser writing into it either fails
(``normal_``, ``uniform_``, ``copy_``: an in-place write to overlapping memory) or changes the
canary (``fill_``, ``zero_``); a parent that rebinds ``.data`` leaves a parameter that is no
longer a placeholder. Each raises ``ShardedInitError``, saying to initialise parameters in
their own module or to pass ``sharded_init=False``. Once the model is built, the
placeholders become empty tensors (no stride-0 tensor reaches ``model.to(device)``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from zeroray.arena import FlatLayout


def _all_module_classes() -> List[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen


class _Recorder:
    """Records parameters in creation order (first registration of each object)."""

    def __init__(self) -> None:
        self.params: List[torch.nn.Parameter] = []
        self.index: Dict[int, int] = {}  # id(param) -> creation index

    def __call__(self, module, name, param):
        if param is not None and id(param) not in self.index:
            self.index[id(param)] = len(self.params)
            self.params.append(param)
        return None


class ShardedInitError(RuntimeError):
    pass


_CANARY = -1234.5
_ADVICE = ("Sharded construction (stage 3) frees each module's parameters as soon as that module is "
           "built, so a parent must not write a child's parameters afterwards (e.g. self.apply(init_fn) "
           "at the end of __init__): initialise parameters in their own module (reset_parameters), or "
           "pass ZeroConfig(sharded_init=False).")


class _Placeholders:
    """Stride-0 stand-ins for freed parameters, and the check that nobody wrote through them."""

    def __init__(self) -> None:
        self.canaries: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}  # 1 element each
        self.freed: List[Tuple[str, torch.nn.Parameter]] = []  # (name, param) still in the model

    def make(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.dtype, p.device)
        if key not in self.canaries:
            self.canaries[key] = torch.full((), _CANARY, dtype=p.dtype, device=p.device)
        return self.canaries[key].expand(p.shape)

    def check(self) -> None:
        for canary in self.canaries.values():
            if not bool(canary == torch.full((), _CANARY, dtype=canary.dtype, device=canary.device)):
                raise ShardedInitError("model_fn wrote into a parameter after its module was built (a "
                                       "fill_/zero_/constant_ on a freed parameter). " + _ADVICE)
        for name, p in self.freed:
            if p.untyped_storage().data_ptr() != self.canaries[(p.dtype, p.device)].untyped_storage().data_ptr():
                raise ShardedInitError(f"model_fn replaced the values of parameter {name!r} after its module "
                                       "was built (assigned its .data). " + _ADVICE)

    def release(self) -> None:
        for _, p in self.freed:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def build_sharded(model_fn: Callable[[], torch.nn.Module], seed: int, world_size: int, rank: int,
                  layout_fn: Optional[Callable[[torch.nn.Module], FlatLayout]] = None
                  ) -> Optional[Tuple[torch.nn.Module, FlatLayout, Dict[str, Tuple[int, int, torch.Tensor]]]]:
    """(model, layout, kept) where kept[name] = (lo, hi, values) is this rank's piece of each
    trainable parameter's flat elements; None if the model cannot be built on ``meta``."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    # Pass 1: structure on meta.
    recorder = _Recorder()
    handle = register_module_parameter_registration_hook(recorder)
    try:
        with torch.device("meta"):
            meta_model = model_fn()
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is built whole
        return None
    finally:
        handle.remove()
    layout = layout_fn(meta_model) if layout_fn is not None else FlatLayout.from_module(meta_model, world_size)
    names = {id(p): n for n, p in meta_model.named_parameters()}
    fates: List[Tuple[str, Optional[str]]] = []  # per created param: ("shard", name) / ("keep", _) / ("drop", _)
    for p in recorder.params:
        name = names.get(id(p))
        if name is None:
            fates.append(("drop", None))
        elif name in layout.slots and p.requires_grad:
            fates.append(("shard", name))
        else:
            fates.append(("keep", name))
    del meta_model

    # Pass 2: for real, partition as each module finishes construction.
    kept: Dict[str, Tuple[int, int, torch.Tensor]] = {}
    placeholders = _Placeholders()
    created = _Recorder()
    done = set()
    depth: Dict[int, int] = {}

    def partition(module: torch.nn.Module) -> None:
        for _, p in module.named_parameters(recurse=False):
            if id(p) in done or id(p) not in created.index:
                continue
            done.add(id(p))
            index = created.index[id(p)]
            if index >= len(fates):
                raise ShardedInitError("model_fn created more parameters than on the meta device")
            fate, name = fates[index]
            if fate == "keep":
                continue
            if fate == "shard":
                slot = layout.slots[name]
                u_lo, u_hi = layout.units[slot.unit].rank_range(rank)
                lo, hi = max(u_lo, slot.offset) - slot.offset, min(u_hi, slot.offset + slot.numel) - slot.offset
                flat = p.detach().reshape(-1)
                kept[name] = (lo, hi, flat[lo:hi].clone()) if hi > lo else (0, 0, flat[:0].clone())
                placeholders.freed.append((name, p))
            p.data = placeholders.make(p)  # freed; see [Note: sharded construction]

    originals = {}
    for cls in _all_module_classes():
        if "__init__" in cls.__dict__:
            originals[cls] = cls.__dict__["__init__"]

            def wrapped(self, *args, __orig=cls.__dict__["__init__"], **kwargs):
                key = id(self)
                depth[key] = depth.get(key, 0) + 1
                try:
                    __orig(self, *args, **kwargs)
                finally:
                    depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
                    partition(self)

            cls.__init__ = wrapped
    handle = register_module_parameter_registration_hook(created)
    try:
        torch.manual_seed(seed)
        try:
            model = model_fn()
        except RuntimeError as e:
            raise ShardedInitError(f"building the model sharded failed ({e}). " + _ADVICE) from e
        partition(model)
        for _, module in model.named_modules():
            partition(module)
        placeholders.check()
        placeholders.release()
    finally:
        handle.remove()
        for cls, init in originals.items():
            cls.__init__ = init
    missing = [n for n in layout.param_names if n not in kept]
    if missing:
        raise ShardedInitError(f"sharded construction lost track of parameters {missing[:5]}: "
                               "pass ZeroConfig(sharded_init=False)")
    return model, layout, kept
