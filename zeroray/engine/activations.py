"""Activations (ZeRO-R's P_a): activation checkpointing, offloading, and counting saved bytes.

[Note: activation checkpointing]
Chosen modules run under ``torch.utils.checkpoint`` (non-reentrant): only their inputs are
kept, and their forward is recomputed during backward. With ``offload_activations`` those
kept inputs go to host memory (pinned on GPU) through ``save_on_cpu``. Under stage 3 the
recomputation runs the submodules' forward hooks again, which gather their parameters; the
checkpointed module's *own* units are fetched by ``enter``/``exit`` around the recomputation,
since its hooks do not fire then. The coordinator never frees on forward hooks during
backward, so the recomputed graph's saved views stay valid until their gradients are done.

The paper also partitions the checkpoints across *model-parallel* ranks, where they are
replicated. zeroray is data parallel only: every rank's activations are different, nothing
is replicated, so there is nothing to partition; offloading is the P_a lever that applies.

[Note: saved-tensor bytes]
On CPU there is no allocator statistic for activations, so the engine counts the bytes of
distinct storages autograd saves during forward (parameters excluded), plus the inputs
kept by checkpointed modules. ``peak`` is the count at the end of the forward, the point
where a step holds most activations.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Set, Tuple, Union

import torch
from torch.utils.checkpoint import checkpoint

from zeroray.engine.forwards import own_forward, restorer
from zeroray.fetch.lifecycle import UnitEvents


def checkpoint_targets(model: torch.nn.Module, spec: Union[bool, Tuple[type, ...]]) -> list:
    """``True``: every element of an nn.ModuleList/Sequential (the model's blocks); a tuple of
    module classes: every module of those classes (outermost only)."""
    if spec is False:
        return []
    targets, covered = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in covered):
            continue
        if spec is True:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
            hit = isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential))
        else:
            hit = isinstance(module, tuple(spec))
        if hit and name:
            targets.append((name, module))
            covered.add(name)
    return targets


class ActivationTracker:
    """Counts saved activation bytes and wraps an optional inner pack/unpack (stage 3's
    ``UnitEvents``, fetch/lifecycle.py)."""

    def __init__(self, is_param_storage: Callable[[int], bool], inner=None) -> None:
        self.is_param_storage, self.inner = is_param_storage, inner
        self._seen: Set[int] = set()
        self.current = 0
        self.peak = 0
        self.checkpointed_inputs = 0

    def begin(self) -> None:
        self._seen.clear()
        self.current = 0
        self.checkpointed_inputs = 0

    def end_forward(self) -> None:
        self.peak = max(self.peak, self.current + self.checkpointed_inputs)

    def pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._seen and not self.is_param_storage(ptr):
                self._seen.add(ptr)
                self.current += t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return self.inner.pack(t) if self.inner is not None else t

    def unpack(self, obj):
        return self.inner.unpack(obj) if self.inner is not None else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def apply_checkpointing(targets: Sequence, offload: bool, tracker: Optional[ActivationTracker],
                        enter: Optional[Callable[[torch.nn.Module], bool]] = None,
                        exit: Optional[Callable[[torch.nn.Module], None]] = None) -> Callable[[], None]:
    """Wrap each target module's forward in a non-reentrant checkpoint; see [Note: activation checkpointing].

    ``enter(module)`` runs before the wrapped forward (True: call ``exit(module)`` after it).
    Returns a function that puts the original forwards back."""
    originals = []
    for _, module in targets:
        original = module.forward
        originals.append(own_forward(module))

        @functools.wraps(original)
        def forward(*args, __orig=original, __module=module, **kwargs):
            def run(*a, **k):
                entered = enter is not None and enter(__module)
                if offload:  # bring offloaded inputs back to the compute device
                    a = tuple(x.to(d, non_blocking=True) if d is not None else x for x, d in zip(a, devices))
                out = __orig(*a, **k)
                if entered:
                    exit(__module)
                return out

            if tracker is not None:
                tracker.checkpointed_inputs += sum(
                    a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
            devices = [a.device if isinstance(a, torch.Tensor) and a.device.type != "cpu" else None for a in args]
            if offload:
                # The inputs a checkpoint keeps are what it was called with: hand it host copies.
                args = tuple(a.to("cpu", non_blocking=True) if d is not None else a for a, d in zip(args, devices))
            return checkpoint(run, *args, use_reentrant=False, **kwargs)

        module.forward = forward

    return restorer(originals)


def track_activations(model: torch.nn.Module, units, spec: Union[bool, Tuple[type, ...]], offload: bool,
                      unit_events: Optional[UnitEvents] = None) -> Tuple[ActivationTracker, Callable[[], None]]:
    """The tracker of the model's saved activations and the checkpointing of ``spec``'s modules
    (with the function that undoes it). ``unit_events``: stage 3's coordinator, which tags saved
    views of its units (pack/unpack) and fetches a checkpointed module's own units in
    recomputation; None where every unit persists (stages 0-2: nothing of it is installed)."""
    if units.persistent:
        arena_ptr = units.arena.untyped_storage().data_ptr()
        is_param = lambda ptr: ptr == arena_ptr  # noqa: E731
    else:
        is_param = lambda ptr: units.unit_at(ptr) is not None  # noqa: E731
    tracker = ActivationTracker(is_param, inner=unit_events)
    restore = apply_checkpointing(checkpoint_targets(model, spec), offload, tracker,
                                  enter=unit_events.enter_module if unit_events is not None else None,
                                  exit=unit_events.exit_module if unit_events is not None else None)
    return tracker, restore
