"""Seeing every read of a trainable parameter, wherever the user's code makes it.

[Note: parameter access]
Module hooks tell when a unit's module runs, but code reads parameters elsewhere too: an
ancestor's forward (``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling
``out_proj``; nanoGPT's root computes ``x @ wte.weight.t()``), ``loss_fn`` (an L2 penalty over
``model.parameters()``), a module that runs only on some steps. So the engine gives its
trainable parameters a class of its own: an ``nn.Parameter`` subclass, made per engine,
whose ``__torch_function__`` hands every parameter an op touches to ``on_access`` before the
op runs, then runs the op as a plain Parameter would (its results are plain tensors). The
coordinator then gathers the parameter's unit if it is not gathered (fetch/unit_fetcher.py), or, outside a
step, raises ``ParameterAccessError`` naming the parameter, instead of letting the op read
a freed buffer. Ops that only read metadata (shape, dtype, ``size()``, the ``.grad``
attribute, hook registration) do not count as reads. Nothing is attached to the tensors:
the side table maps ``id(param)`` to the parameter's name and unit.

At stages 1-2, where parameters are resident, the class is installed only while a publish
is writing into them ([Note: reads during a publish] in fetch/publish.py); stage 3 keeps it on.

Only code that goes through torch's Python API is seen; a C++ extension handed a parameter
directly is not (it would find its storage empty and fail, never read stale memory).
Autograd's own reads in backward go through the saved-tensor hooks instead (fetch/unit_fetcher.py).
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Tuple

import torch

_METADATA = frozenset(getattr(torch.Tensor, n) for n in (
    "size", "dim", "numel", "nelement", "ndimension", "stride", "element_size", "is_floating_point",
    "is_complex", "is_contiguous", "__len__", "__hash__", "untyped_storage", "register_hook",
    "register_post_accumulate_grad_hook", "requires_grad_", "storage_offset", "get_device"))
_DESCRIPTOR_CALLS = ("__get__", "__set__", "__delete__")


def _is_metadata(func) -> bool:
    if func in _METADATA:
        return True
    if getattr(func, "__name__", None) in _DESCRIPTOR_CALLS:
        # Attribute access (p.shape, p.grad = ...): only ``.data`` hands out the values.
        return getattr(getattr(func, "__self__", None), "__name__", None) != "data"
    return False


class ParameterAccess:
    """Installs the per-engine parameter class on ``params`` (name -> parameter) and calls
    ``on_access(name, unit)`` for each trainable parameter an op is about to read."""

    def __init__(self, params: Dict[str, torch.nn.Parameter], unit_of: Dict[str, int],
                 on_access: Callable[[str, int], None]) -> None:
        self._params = dict(params)
        self._table: Dict[int, Tuple[str, int]] = {id(p): (n, unit_of[n]) for n, p in self._params.items()}
        self._on_access = on_access
        self.cls = _make_class(weakref.ref(self))

    def install(self) -> None:
        """Reads are seen from now on (again, after ``suspend``)."""
        for p in self._params.values():
            p.__class__ = self.cls

    def suspend(self) -> None:
        """Plain nn.Parameters until the next ``install``: no read is seen, none costs anything
        (stages 1-2 between publishes: [Note: reads during a publish] in fetch/publish.py)."""
        for p in self._params.values():
            if type(p) is self.cls:
                p.__class__ = torch.nn.Parameter

    def remove(self) -> None:
        """Back to plain nn.Parameter: the class (and through it this object) is released."""
        self.suspend()
        self._params.clear()
        self._table.clear()

    def _seen(self, args, kwargs) -> None:
        for a in args:
            if type(a) is self.cls:
                self._on_access(*self._table[id(a)])
            elif type(a) in (list, tuple):
                for b in a:
                    if type(b) is self.cls:
                        self._on_access(*self._table[id(b)])
        if kwargs:
            self._seen(tuple(kwargs.values()), None)


def _make_class(owner: "weakref.ref[ParameterAccess]") -> type:
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not _is_metadata(func):
            access = owner()
            if access is not None:
                access._seen(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    return type("ZeroParameter", (torch.nn.Parameter,), {
        "__torch_function__": classmethod(__torch_function__),
        "__doc__": "A trainable parameter whose reads zeroray sees; see [Note: parameter access].",
    })
