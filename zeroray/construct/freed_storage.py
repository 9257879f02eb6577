"""Parameters whose memory is freed while the model is still being built, and brought back
whenever an operation touches them: the mechanism behind [Note: sharded construction]
(zeroray/construct/sharded_init.py).

[Note: freed parameters]
Each tracked parameter's *storage* is freed in place: its bytes are swapped for a mapping of
zero pages (no resident memory; ``resize_(0)`` off the CPU), while the storage object, every
view of it (``.data``, ``t()``, ``w[0]``) and the parameter's identity survive. Code that
reads around the dispatcher (tensor printing, ``.numpy()``) sees zeros rather than freed
memory; what it writes there is lost. The side table is keyed by the storage
(``untyped_storage()._cdata``), so a view made before or after the free is the same entry.
What stays is this rank's slice of the flat values (``kept``, elements ``[lo, hi)``, written
into the caller's ``dest``); nothing for a parameter the final model drops.

While ``model_fn`` runs, ``StorageFreer`` (a ``TorchDispatchMode``) sees every aten op. An
op that touches a freed storage first *materialises* it: full size again, NaN everywhere,
the kept slice copied back in. The op then runs on the real, full-size tensor, so
``normal_`` / ``uniform_`` draw exactly the random numbers the whole build draws, and the
rank's slice of the result is exact. The storage stays materialised ("hot") until an op or a
registration touches *another* tracked storage; then it is sliced again and freed. At most
the storages one op touches are hot at a time.

Each hot storage is *known* (every element holds what the whole build has) or not (only the
rank's slice is real, the rest NaN). A newly registered parameter is known. A storage
becomes known when an op overwrites all of it without reading it (``normal_``, ``uniform_``,
``fill_``, ``zero_``, ``copy_``, an ``out=`` op), which is how initialisers start; ops on
known values keep it known. So an op may read a *known* storage into anything
(``trunc_normal_``'s rejection loop reads its samples back; a parent may read a child's
freshly initialised bias). Reading an *unknown* storage into a new tensor, a scalar, or a
tensor that is not tracked would leak the NaN stand-ins, so it raises ``CannotShard``, and
the model is built whole instead.

An op that writes an unknown storage from unknown values (``mul_`` after the storage was
freed and brought back, or ``a.copy_(b)`` between two freed parameters) is exact within the
slice if it is elementwise. Whether it was is checked by NaN poisoning when the storage is
freed again: NaN that appears in the slice where the kept values had none came from another
element, and raises ``CannotShard``. Exact for every op that propagates NaN; an in-place op
that reads other elements of the same storage and drops NaN (``where`` / ``fmax`` into
itself) would escape it: none of ``torch.nn.init`` or ``transformers`` does.

``module.to(dtype)`` copies each parameter (``_to_copy``) and assigns the copy to ``.data``:
an elementwise copy of a whole unknown parameter is tracked like it (same slice), and handed
to the parameter it is assigned to.

``.data = tensor`` does not go through the dispatcher. ``check_rebinds`` compares each
tracked parameter's storage with the one it tracks; a new one is sliced and freed. It runs
whenever ops have allocated ``scan_bytes`` of new tensors since the last check (so rebound
values wait at most that long) and at the end.

A parameter that does not own a storage of its own (a view into a larger tensor, not
contiguous, not floating point) is not freed: it stays whole until the end and is sliced
then.
"""
from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroray.memory.unit_pool import anonymous_storage


class CannotShard(Exception):
    """This model cannot be built sharded; the message says why (the model is built whole)."""


# Ops that overwrite every element of their written operand without reading it.
_OVERWRITES = frozenset(f"aten::{n}" for n in (
    "normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "cauchy_",
    "log_normal_", "geometric_", "copy_"))
# Elementwise copies (dtype or device conversion) of their first operand.
_CONVERSIONS = frozenset(("aten::_to_copy", "aten::clone"))
# Ops that read only the shape, dtype and device of their tensor operands, never the values.
_METADATA_ONLY = frozenset(f"aten::{n}" for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "is_same_size",
    "_has_compatible_shallow_copy_type", "size", "stride", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset"))


def storage_key(t: torch.Tensor) -> Optional[int]:
    """The identity of ``t``'s storage (shared by all its views), None when it has none."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def owns_its_storage(p: torch.Tensor) -> bool:
    """Freeable: floating point, contiguous, and exactly the whole of its storage."""
    return (p.layout == torch.strided and not p.is_meta and (p.is_floating_point() or p.is_complex())
            and p.numel() > 0 and p.is_contiguous() and p.storage_offset() == 0
            and p.numel() * p.element_size() == p.untyped_storage().nbytes())


def _covers(t: torch.Tensor, nbytes: int) -> bool:
    """True when ``t`` is every element of a storage of ``nbytes`` bytes, each once."""
    return (t.numel() * t.element_size() == nbytes and t.storage_offset() == 0
            and torch._debug_has_internal_overlap(t) == 0)


def _free(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give back a storage's memory, in place (the same storage object for every view)."""
    if storage.device.type == "cpu":
        # Zero pages: readable without resident memory, so that code reading around the
        # dispatcher (tensor printing, .numpy()) sees zeros instead of crashing on freed memory.
        try:
            storage._swap_data_ptr_(anonymous_storage(nbytes))
            return
        except OSError:  # out of mappings (vm.max_map_count): free it the plain way
            pass
    storage.resize_(0)


@dataclass(eq=False)
class _Freed:
    """One tracked storage; see [Note: freed parameters]."""

    key: int
    storage: torch.UntypedStorage
    nbytes: int
    flat: torch.Tensor                  # 1D view of every element, in the parameter's dtype
    owner: Optional[torch.nn.Parameter]  # the parameter whose values these are; None once rebound
    label: str                          # the parameter's name in the final model, for messages
    lo: int
    hi: int
    kept: torch.Tensor                  # 1D, elements [lo, hi) as of the last free
    dest: Optional[torch.Tensor] = None  # 1D, where the owner's slice goes (a view of the shard arena)
    hot: bool = True                    # bytes allocated (False: freed, see _free)
    known: bool = True                  # every element holds the whole build's value
    dirty: bool = True                  # written since the last free
    nan_base: Optional[torch.Tensor] = None  # NaN positions of the slice when it became unknown
    writer: str = ""                    # last op that wrote it while unknown
    adoptable: bool = False             # a converted copy of a parameter, not yet given back to it

    @property
    def full(self) -> bool:
        return self.owner is not None and self.lo == 0 and self.hi == self.flat.numel()


@dataclass(eq=False)
class _Whole:
    """A parameter that could not be freed (see owns_its_storage): sliced at the end."""

    param: torch.nn.Parameter
    label: str
    lo: int
    hi: int


class _HeapTrim:
    """Hands freed heap memory back to the OS every ``every`` freed bytes.

    glibc serves allocations under its mmap threshold (which rises to 32 MiB as large blocks
    are freed) from the heap, and keeps what is freed there. Between materialisations a
    model allocates small long-lived tensors (a layer's buffers) into the holes, so the next
    parameter no longer fits and the heap grows by every layer: a 355M GPT-2 built sharded
    peaked at the whole model's RSS. ``malloc_trim(0)`` returns the free pages, holes
    included. A no-op where the C library has no ``malloc_trim``."""

    def __init__(self, every: int) -> None:
        self.every, self.pending = every, 0
        try:
            self.fn = getattr(ctypes.CDLL(None), "malloc_trim", None)
        except OSError:
            self.fn = None

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.fn is not None and self.pending >= self.every:
            self.pending = 0
            self.fn(0)


class StorageFreer(TorchDispatchMode):
    """Frees tracked parameters' storages and brings them back for every op that touches them."""

    def __init__(self, scan_bytes: int, trim_bytes: int) -> None:
        super().__init__()
        self.scan_bytes = scan_bytes
        self.trim = _HeapTrim(trim_bytes)
        self.records: Dict[int, _Freed] = {}    # storage key -> record
        self.params: Dict[int, _Freed] = {}     # id(param) -> its current record
        self.whole: Dict[int, _Whole] = {}      # id(param) -> not freeable, kept whole
        self.hot: Dict[int, _Freed] = {}        # storage key -> materialised record
        self.fresh = 0                          # bytes of new tensors since the last rebind check
        self._busy = False                      # our own ops pass straight through
        self.failure: Optional[str] = None      # the first reason, even if model_fn caught the raise

    def fail(self, reason: str) -> CannotShard:
        """Remembers why, so that model code catching the exception cannot hide it."""
        if self.failure is None:
            self.failure = reason
        return CannotShard(self.failure)

    # --- tracking ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def quiet(self):
        """Ops run inside pass straight through (the bookkeeping's own tensors)."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def track(self, param: torch.nn.Parameter, label: str, lo: int, hi: int,
              dest: Optional[torch.Tensor] = None) -> None:
        """Start tracking a newly registered parameter; it stays hot until something else is
        touched. Its slice is written to ``dest`` (``hi - lo`` elements, its dtype) if given."""
        with self.quiet():
            self._track(param, label, lo, hi, dest)

    def _track(self, param: torch.nn.Parameter, label: str, lo: int, hi: int,
               dest: Optional[torch.Tensor] = None) -> None:
        key = storage_key(param)
        if key is not None and key in self.records:
            raise self.fail(f"parameter {label!r} shares memory with parameter {self.records[key].label!r}")
        if key is None or not owns_its_storage(param):
            self.whole[id(param)] = _Whole(param, label, lo, hi)
            return
        self._evict_all()
        flat = param.detach().view(-1)
        if dest is not None and (dest.dtype != param.dtype or dest.numel() != hi - lo):
            dest = None  # given other values (.data = a tensor of another dtype): a private copy
        rec = _Freed(key, param.untyped_storage(), param.untyped_storage().nbytes(), flat, param, label,
                     lo, hi, flat[:0].clone(), dest)
        self.records[key] = rec
        self.params[id(param)] = rec
        self.hot[key] = rec

    def holds(self, t: torch.Tensor) -> Optional[str]:
        """The label of the tracked parameter whose memory ``t`` shares, if any."""
        key = storage_key(t)
        rec = self.records.get(key) if key is not None else None
        return rec.label if rec is not None else None

    def kept(self, param: torch.nn.Parameter) -> Tuple[str, int, int, torch.Tensor]:
        """(label, lo, hi, values) of a tracked parameter after ``finish``."""
        rec = self.params.get(id(param))
        if rec is not None:
            return rec.label, rec.lo, rec.hi, rec.kept
        whole = self.whole[id(param)]
        owner = self.holds(param)
        if owner is not None:
            raise self.fail(f"parameter {whole.label!r} shares memory with parameter {owner!r}")
        values = param.detach().reshape(-1)[whole.lo:whole.hi].clone()
        return whole.label, whole.lo, whole.hi, values

    def is_tracked(self, param: torch.nn.Parameter) -> bool:
        """Registered as a sharded or dropped parameter (freed or kept whole until the end)."""
        return id(param) in self.params or id(param) in self.whole

    def finish(self) -> None:
        """After ``model_fn``: pick up rebound ``.data`` and free every storage still hot."""
        with self.quiet():
            self.check_rebinds()
            self._evict_all()
        if self.failure is not None:
            raise CannotShard(self.failure)

    def release(self) -> None:
        """Forget every tracked storage, once the kept slices have been collected: whatever
        still refers to this object (a frame that an import kept alive, say) then holds no
        parameter memory and no view of the caller's shard arena."""
        self.records.clear()
        self.params.clear()
        self.whole.clear()
        self.hot.clear()

    # --- materialise / free -----------------------------------------------------------------

    def _materialise(self, rec: _Freed, blank: bool) -> None:
        rec.storage._swap_data_ptr_(torch.UntypedStorage(rec.nbytes, device=rec.storage.device))
        rec.hot, rec.known, rec.nan_base = True, rec.full, None
        if not blank:  # blank: the op overwrites every element without reading any
            if not rec.full:
                rec.flat.fill_(float("nan"))
            if rec.hi > rec.lo:
                rec.flat[rec.lo:rec.hi].copy_(rec.kept)
        self.hot[rec.key] = rec

    def _evict(self, rec: _Freed) -> None:
        if rec.dirty and (rec.owner is not None or rec.adoptable) and rec.hi > rec.lo:
            new = rec.flat[rec.lo:rec.hi]
            if not rec.known:
                base = rec.nan_base if rec.nan_base is not None else torch.isnan(rec.kept)
                if bool((torch.isnan(new) & ~base).any()):
                    raise self.fail(f"{rec.writer} mixed values across ranks' slices of parameter "
                                    f"{rec.label!r} (an in-place op that is not elementwise, run on "
                                    "it after it was built)")
            if rec.dest is not None and rec.owner is not None:
                rec.kept = rec.dest.copy_(new)
            else:
                rec.kept = new.clone()
        _free(rec.storage, rec.nbytes)
        self.trim.freed(rec.nbytes)
        rec.hot, rec.known, rec.dirty, rec.nan_base = False, False, False, None
        self.hot.pop(rec.key, None)

    def _evict_all(self, but: Tuple[int, ...] = ()) -> None:
        for key in [k for k in self.hot if k not in but]:
            self._evict(self.hot[key])

    def check_rebinds(self) -> None:
        """Tracked parameters given new values with ``.data = ...`` are sliced and freed again."""
        for rec in list(self.params.values()):
            param = rec.owner
            key = storage_key(param)
            if key == rec.key:
                continue
            del self.params[id(param)]
            rec.owner = None  # an orphan: views of the old values may still be written
            other = self.records.get(key) if key is not None else None
            if (other is not None and other.adoptable and other.label == rec.label
                    and other.flat.numel() == param.numel()):
                other.owner, other.adoptable = param, False  # module.to(dtype): the converted values
                self.params[id(param)] = other
                continue
            if other is not None:
                raise self.fail(f"parameter {rec.label!r} was given the memory of parameter "
                                f"{other.label!r} (a .data assignment)")
            self._track(param, rec.label, rec.lo, rec.hi, rec.dest)
            new = self.params.get(id(param))
            if new is not None:
                self._evict(new)

    # --- dispatch ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._busy:
            return func(*args, **kwargs)
        operands = _operands(func, args, kwargs)
        touched = {}
        for t, _, _ in operands:
            key = storage_key(t)
            if key is not None and key in self.records:
                touched[key] = self.records[key]
        if not touched:
            out = func(*args, **kwargs)
            self._count_fresh(func, out)
            return out
        return self._run_touching(func, args, kwargs, operands, touched)

    def _run_touching(self, func, args, kwargs, operands, touched: Dict[int, _Freed]):
        if self.failure is not None:  # never let an op run on freed memory
            raise CannotShard(self.failure)
        schema = func._schema
        name = schema.name
        pure = name in _OVERWRITES
        self._evict_all(but=tuple(touched))
        # (record, tensor, written, read) for every operand on a tracked storage
        uses = []
        for t, write, is_out in operands:
            key = storage_key(t)
            if key in touched:
                overwritten = write and (pure or is_out) and _covers(t, touched[key].nbytes)
                uses.append((touched[key], t, write, not write or not overwritten))
        for key, rec in touched.items():
            if not rec.hot:
                read = any(r is rec and reads for r, _, _, reads in uses)
                overwritten = any(r is rec and w and not reads for r, _, w, reads in uses)
                self._materialise(rec, blank=overwritten and not read)
        fresh_returns = any(r.alias_info is None for r in schema.returns)
        writes_any = any(w for _, w, _ in operands)
        if name in _METADATA_ONLY or (not writes_any and not fresh_returns):  # shape-only, or a view
            return func(*args, **kwargs)
        reads = [rec for rec, _, _, r in uses if r]
        unknown = [rec for rec in reads if not rec.known]
        untracked_writes = any(w and storage_key(t) not in touched for t, w, _ in operands)
        if unknown and not untracked_writes and self._is_conversion(func, args, uses):
            return self._convert(func, args, kwargs, uses[0][0])
        if unknown and (fresh_returns or untracked_writes):
            raise self.fail(f"{name} reads parameter {unknown[0].label!r} after it was freed (this rank "
                            "keeps only its slice) into a new tensor or value")
        others_known = all(rec.known for rec, _, w, r in uses if r and not w)
        updates = []
        for rec, t, write, read in uses:
            if write:
                after = others_known and (rec.known or not read)
                if rec.known and not after and rec.hi > rec.lo and rec.owner is not None:
                    rec.nan_base = torch.isnan(rec.flat[rec.lo:rec.hi])
                updates.append((rec, after))
        out = func(*args, **kwargs)
        for rec, after in updates:
            rec.dirty, rec.known = True, after
            if not after:
                rec.writer = name
        self._count_fresh(func, out)
        return out

    @staticmethod
    def _is_conversion(func, args, uses) -> bool:
        """``clone`` / ``_to_copy`` of a whole parameter: the first half of ``module.to(dtype)``."""
        if func._schema.name not in _CONVERSIONS or len(uses) != 1:
            return False
        rec, t, _, _ = uses[0]
        return t is args[0] and t.is_contiguous() and t.numel() == rec.flat.numel() and rec.owner is not None

    def _convert(self, func, args, kwargs, src: _Freed) -> torch.Tensor:
        """Run an elementwise copy of an unknown parameter; its output is tracked with the same
        slice, waiting for a ``.data =`` to give it back to a parameter (``check_rebinds``)."""
        out = func(*args, **kwargs)
        if not owns_its_storage(out):
            raise self.fail(f"{func._schema.name} copies parameter {src.label!r} after it was freed "
                            "(this rank keeps only its slice)")
        key = storage_key(out)
        flat = out.detach().view(-1)
        rec = _Freed(key, out.untyped_storage(), out.untyped_storage().nbytes(), flat, None, src.label,
                     src.lo, src.hi, flat[:0].clone(), known=False, adoptable=True)
        rec.nan_base = torch.isnan(flat[rec.lo:rec.hi])
        rec.writer = func._schema.name
        self.records[key] = rec
        self.hot[key] = rec
        return out

    def _count_fresh(self, func, out) -> None:
        if all(r.alias_info is not None for r in func._schema.returns):
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                self.fresh += t.numel() * t.element_size()
        if self.fresh >= self.scan_bytes:
            self.fresh = 0
            self.check_rebinds()


def _operands(func, args, kwargs) -> List[Tuple[torch.Tensor, bool, bool]]:
    """(tensor, written, is an out= argument) for every tensor operand of an aten op."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        value = kwargs.get(arg.name) if (arg.kwarg_only or i >= len(args)) else args[i]
        write = arg.alias_info is not None and arg.alias_info.is_write
        if isinstance(value, torch.Tensor):
            out.append((value, write, arg.is_out))
        elif isinstance(value, (list, tuple)):
            out.extend((v, write, arg.is_out) for v in value if isinstance(v, torch.Tensor))
    return out
