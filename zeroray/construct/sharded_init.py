"""Sharded construction for stage 3: the full model never exists on one worker.

[Note: sharded construction]
Goal: each worker ends with the values ``torch.manual_seed(seed); model_fn()`` gives in one
process, bit for bit (the same random numbers drawn in the same order), but keeps only its
slice of each trainable parameter, and never holds the whole model on the way.

Which slice to keep depends on where each parameter ends up in the *final* model (its unit
and offset in the flat layout, whether a parent later ties or freezes it), which is not
known while the model is half built. So construction runs twice:
1. on the ``meta`` device (no memory, no random numbers drawn): the final structure, hence
   the FlatLayout (from ``layout_fn``) and each parameter's fate, listed in the order the
   parameters are first registered with a module;
2. for real, after ``torch.manual_seed(seed)``: each parameter is matched to its fate by
   registration order (the same in both passes, checked by shape and dtype) as it is
   registered. Trainable parameters keep the rank's range of their unit; frozen ones stay
   whole (they are replicated); parameters the final model no longer holds (the untied
   weight of a tied layer) keep nothing.
A trainable or dropped parameter's memory is freed as soon as it is registered and brought
back for every op that touches it ([Note: freed parameters], zeroray/construct/freed_storage.py), so
parents may initialise their children afterwards: ``self.apply(init)``, Hugging Face
``post_init``, ``nn.MultiheadAttention``'s ``constant_(self.out_proj.bias, 0.)``, a loop over
``named_parameters()``, ``child.weight.data = tensor``.

Peak memory per worker while ``model_fn`` runs:
    this rank's slices: one arena per dtype laid out as the rank's local shard
      (``FlatLayout.param_shard_view``; ``kept`` values are views of it), filled as
      parameters are freed
    + the parameters one op touches, materialised whole: almost always one, so at most the
      largest parameter (two for ``a.copy_(b)`` between parameters)
    + frozen parameters and buffers, whole (as after construction)
    + what ``model_fn`` itself holds besides parameters: temporaries, and values it assigns
      to a ``.data``, sliced once at most ``scan_bytes`` (the larger of the largest parameter
      and 1/64 of the model) of new tensors were allocated
    + parameters that do not own their memory (views into a larger tensor, non-contiguous),
      whole until the end.
So: the shard plus the largest parameter for the usual model, where the previous design (a
parameter freed when its module's ``__init__`` returned, a parent's later writes refused)
held the shard plus the largest module. Measured by ``benchmarks/construction_memory.py``:
355M-parameter GPT-2 (transformers), 4 workers: 565 MB per worker (shard 355 MB + largest
parameter, the 206 MB token embedding) vs 1,627 MB built whole. Keeping this bound in
resident memory needs freed heap pages handed back to the OS as we go (``_HeapTrim`` in
zeroray/construct/freed_storage.py); otherwise glibc's fragmented heap grows to the whole model.
The first sharded build in a process also imports torch's meta and dispatch machinery.

What cannot be built sharded falls back to a whole build with one warning: a model that
does not run on ``meta`` (reads ``.item()`` while being built), one that reads a freed
parameter into a new tensor (``self.scale = self.a.weight.sum()`` after more modules were
built), an in-place op that mixes a freed parameter's elements across ranks' slices, or
parameters that share memory. ``build_sharded`` then returns None and the caller runs
``torch.manual_seed(seed); model_fn()``. Ranks decide alone: an in-place op that is exact on
one rank's slice and not on another's (``cumsum_``) leaves one rank sharded and the other
built whole, with the same values either way.
"""
from __future__ import annotations

import logging
import random
import sys
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

from zeroray.layout.arena import FlatLayout
from zeroray.construct.freed_storage import CannotShard, StorageFreer

log = logging.getLogger("zeroray")

Kept = Dict[str, Tuple[int, int, torch.Tensor]]


def _owned_range(layout: FlatLayout, name: str, rank: int) -> Tuple[int, int]:
    """The flat elements ``[lo, hi)`` of parameter ``name`` that ``rank`` owns; (0, 0) if none."""
    return layout.param_shard_range(name, rank)[1:]


class _HostRandom:
    """Python's and numpy's global random states, so that the meta pass leaves no trace."""

    def __init__(self) -> None:
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class _Fate(NamedTuple):
    """What becomes of one registered parameter: ``shard`` (as ``name``), ``keep`` whole, or
    ``drop`` (the final model does not hold it); with its shape and dtype as registered."""

    kind: str
    name: Optional[str]
    shape: torch.Size
    dtype: torch.dtype


class _Registrations:
    """Parameters in the order they are first registered with a module (this thread only)."""

    def __init__(self, on_new: Callable[[torch.nn.Parameter, int], None] = lambda p, index: None) -> None:
        self.params: List[torch.nn.Parameter] = []
        self.specs: List[Tuple[torch.Size, torch.dtype]] = []  # as registered (a later .to() changes it)
        self.seen: set = set()
        self.on_new = on_new
        self.thread = threading.get_ident()

    def __call__(self, module, name, param):
        if param is None or id(param) in self.seen or threading.get_ident() != self.thread:
            return None
        self.seen.add(id(param))
        self.params.append(param)
        self.specs.append((param.shape, param.dtype))
        self.on_new(param, len(self.params) - 1)
        return None


def _meta_pass(model_fn, layout_fn) -> Tuple[FlatLayout, List[_Fate]]:
    host = _HostRandom()
    recorder = _Registrations()
    handle = register_module_parameter_registration_hook(recorder)
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception as e:  # noqa: BLE001 - the reason goes into the fallback warning
        raise CannotShard(f"model_fn does not run on the meta device ({type(e).__name__}: {e})") from e
    finally:
        handle.remove()
        host.restore()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    layout = layout_fn(model)
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    sharded = set(layout.param_names)
    fates = []
    for p, (shape, dtype) in zip(recorder.params, recorder.specs):
        ns = names.get(id(p), [])
        canonical = [n for n in ns if n in sharded]
        kind, name = ("shard", canonical[0]) if canonical else ("keep", ns[0]) if ns else ("drop", None)
        fates.append(_Fate(kind, name, shape, dtype))
    return layout, fates


def _real_pass(model_fn, seed: int, layout: FlatLayout, fates: List[_Fate], rank: int
               ) -> Tuple[torch.nn.Module, StorageFreer]:
    sizes = [f.shape.numel() * f.dtype.itemsize for f in fates if f.kind != "keep"]  # the freed ones
    freer = StorageFreer(scan_bytes=max(max(sizes, default=0), sum(sizes) // 64, 1 << 20), trim_bytes=16 << 20)

    arenas: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}  # 1D, laid out as the local shard

    # on_new must not refer to ``registrations``, which holds it: a reference cycle would keep
    # ``arenas`` (the rank's whole shard) alive after construction until the cyclic collector ran.
    def on_new(param: torch.nn.Parameter, index: int) -> None:
        if index >= len(fates):
            raise freer.fail("model_fn registered more parameters than on the meta device")
        fate = fates[index]
        if tuple(param.shape) != tuple(fate.shape) or param.dtype != fate.dtype:
            raise freer.fail(f"model_fn built parameter {index} as {tuple(param.shape)} {param.dtype} but as "
                              f"{tuple(fate.shape)} {fate.dtype} on the meta device")
        if fate.kind == "shard":
            where = (param.dtype, param.device)
            if where not in arenas:
                with freer.quiet():  # pages are touched only as slices are written
                    arenas[where] = torch.empty(layout.shard_numel, dtype=param.dtype, device=param.device)
            dest, lo, hi = layout.param_shard_view(arenas[where], fate.name, rank)
            freer.track(param, fate.name, lo, hi, dest)
        elif fate.kind == "drop":
            freer.track(param, f"<a {tuple(fate.shape)} parameter the final model does not hold>", 0, 0)

    registrations = _Registrations(on_new)
    handle = register_module_parameter_registration_hook(registrations)
    try:
        torch.manual_seed(seed)
        with freer:
            model = model_fn()
        freer.finish()
    except CannotShard:
        raise
    except Exception as e:  # noqa: BLE001 - the whole build will show it again if it is the model's
        raise CannotShard(f"model_fn raised {type(e).__name__} while being built sharded: {e}") from e
    finally:
        handle.remove()
    return model, freer


def _collect(model: torch.nn.Module, layout: FlatLayout, freer: StorageFreer, rank: int) -> Kept:
    """Every sharded parameter's kept slice; checks that nothing else lost its values."""
    params = dict(model.named_parameters(remove_duplicate=False))
    kept: Kept = {}
    for name in layout.param_names:
        p = params.get(name)
        if p is None:
            raise CannotShard(f"the built model has no parameter {name!r}, unlike the one built on the meta device")
        if freer.is_tracked(p):
            label, lo, hi, values = freer.kept(p)
            if label != name or (lo, hi) != _owned_range(layout, name, rank):
                raise CannotShard(f"parameter {name!r} was built in another order than on the meta device")
        elif freer.holds(p):
            raise CannotShard(f"parameter {name!r} shares memory with parameter {freer.holds(p)!r}")
        else:  # never registered through register_parameter: it was never freed
            lo, hi = _owned_range(layout, name, rank)
            values = p.detach().reshape(-1)[lo:hi].clone()
        kept[name] = (lo, hi, values)
    sharded = {id(params[n]) for n in layout.param_names}
    for name, p in params.items():
        if id(p) not in sharded and freer.holds(p):
            raise CannotShard(f"parameter {name!r} shares memory with trained parameter {freer.holds(p)!r}")
    for name, b in model.named_buffers(remove_duplicate=False):
        if freer.holds(b):
            raise CannotShard(f"buffer {name!r} shares memory with parameter {freer.holds(b)!r}")
    for mname, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and freer.holds(value):
                raise CannotShard(f"attribute {(mname + '.' if mname else '') + attr!r} is a view of parameter "
                                  f"{freer.holds(value)!r}")
    return kept


def build_sharded(model_fn: Callable[[], torch.nn.Module], seed: int, world_size: int, rank: int,
                  layout_fn: Optional[Callable[[torch.nn.Module], FlatLayout]] = None,
                  ) -> Optional[Tuple[torch.nn.Module, FlatLayout, Kept]]:
    """Build ``model_fn()`` keeping only ``rank``'s slices; see [Note: sharded construction].

    Returns ``(model, layout, kept)``: ``layout = layout_fn(model)`` (default
    ``FlatLayout.from_module(model, world_size)``), and ``kept[name] = (lo, hi, values)`` for
    every parameter in the layout: its flat elements ``[lo, hi)`` that this rank owns, exactly
    as ``torch.manual_seed(seed); model_fn()`` makes them ((0, 0, empty) when it owns none).
    Those parameters are left empty in ``model``; frozen parameters and buffers are whole.
    Random numbers are drawn as in the plain build, so the random state afterwards matches.

    Returns None, after logging one warning that says why, when the model cannot be built
    sharded; the caller then builds it whole with ``torch.manual_seed(seed); model_fn()``.
    """
    if layout_fn is None:
        def layout_fn(m: torch.nn.Module) -> FlatLayout:
            return FlatLayout.from_module(m, world_size)
    host = _HostRandom()
    try:
        layout, fates = _meta_pass(model_fn, layout_fn)
        model, freer = _real_pass(model_fn, seed, layout, fates, rank)
        kept = _collect(model, layout, freer, rank)
        freer.release()
    except CannotShard as e:
        host.restore()
        log.warning("zeroray: rank %d cannot build the model sharded, so it builds it whole (which needs "
                    "memory for the whole model): %s. ZeroConfig(sharded_init=False) skips the attempt.",
                    rank, e)
        return None
    for name in layout.param_names:  # the rest of each parameter is gone
        p = model.get_parameter(name)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return model, layout, kept
