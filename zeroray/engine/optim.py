"""The sharded optimizer: fp32 master shard, inner torch optimizer, global-norm clipping, loss scaler.

[Note: flat optimizer]
The inner ``torch.optim`` optimizer sees a few flat 1-D parameters, one per *segment*: a
run of the local shard whose elements share the same parameter-group overrides. Adam,
AdamW and SGD are elementwise, so updating a flat slice equals updating the parameters it
covers, and the optimizer state is a few contiguous tensors (M_D). Padding elements have
zero value and zero gradient and stay zero under these optimizers. An optimizer that mixes
elements (per-tensor norms, as in LAMB) would not match the unsharded run: it takes the
whole-parameter path instead ([Note: optimizer paths] in engine/optim_choice.py).
When the master is not one tensor (stages 1-2 in fp32: the rank's rows of the parameter
arena, [Note: local shard] in layout/local_shard.py), segments are also cut where its pieces
meet, one unit's slice each, so every segment is a view and the update lands in place.
A step that leaves some parameters without a gradient on every rank splits the segments
holding them into flat pieces, so that the inner optimizer skips exactly those parameters
([Note: unused parameters] in engine/flat_pieces.py); checkpoints then carry the scalar state per
element ([Note: per-element state]). The pieces' per-element state tensors are views of one flat
tensor per key, which an export returns as it is or copies in one pass ([Note: flat optimizer
state] in engine/flat_state.py).

The same class serves stage 0, where the "shard" is the whole model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from zeroray.engine.flat_pieces import FlatPieces
from zeroray.engine.flat_state import FlatState
from zeroray.engine.optim_record import decode_hyperparameters, group_key, hyperparameters, load_scheduler_state, \
    scheduler_state
from zeroray.layout.local_shard import LocalShard
from zeroray.layout.owners import is_owned_key
from zeroray.offload.master import DiskMaster
from zeroray.offload.stepper import DiskStepper, make_stepper


@dataclass(frozen=True)
class DiskOffload:
    """Where the optimizer state goes with offload="disk" ([Note: disk offload] in offload/stepper.py):
    the parent folder (None: the system's temporary directory), this rank, bytes per chunk."""
    folder: Optional[str]
    rank: int
    chunk_bytes: int


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    overrides: Tuple[Tuple[str, Any], ...]  # sorted items of the param-group overrides

    @property
    def key(self) -> str:
        return group_key(dict(self.overrides))


class LossScaleError(RuntimeError):
    pass


class LossScaler:
    """fp16 dynamic loss scaling; every rank holds the same state and sees the same overflow."""

    def __init__(self, initial: float, growth: float, backoff: float, interval: int, minimum: float) -> None:
        self.scale, self.growth, self.backoff, self.interval, self.minimum = initial, growth, backoff, interval, minimum
        self.good_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        if overflow:
            new = self.scale * self.backoff
            if new < self.minimum:
                raise LossScaleError(
                    f"step {step}: gradients overflowed at loss scale {self.scale:g} and the scale would fall "
                    f"below min_loss_scale={self.minimum:g}. The fp16 range is too small for this model's "
                    "gradients: try dtype='bf16', a lower learning rate, gradient clipping (max_grad_norm), "
                    "or a smaller min_loss_scale.")
            self.scale = new
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.interval == 0:
                self.scale *= self.growth

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def param_overrides(names: Sequence[str], named: Dict[str, torch.nn.Parameter],
                    param_groups: Optional[Callable[[str, torch.nn.Parameter], dict]]) -> Dict[str, Dict[str, Any]]:
    """What ``param_groups(name, param)`` overrides (lr, weight_decay, ...) for each parameter of ``names``."""
    out = {}
    for name in names:
        overrides = dict(param_groups(name, named[name]) or {}) if param_groups else {}
        if "params" in overrides:
            raise ValueError(f"param_groups({name!r}) returned a 'params' key: return only the "
                             "overrides (lr, weight_decay, ...) for that parameter")
        out[name] = overrides
    return out


def local_spans(param_spans: Dict[str, Tuple[int, int]],
                overrides: Mapping[str, Dict[str, Any]]) -> List[Tuple[int, int, dict]]:
    """(start, end, overrides) of each parameter's piece in the master tensor, in order:
    ``param_spans`` with what ``param_groups`` overrides for it (``param_overrides``)."""
    return [(start, end, overrides[name]) for name, (start, end) in param_spans.items()]


def build_inner(builder: Callable[[List[dict]], Any], groups: List[dict]) -> torch.optim.Optimizer:
    """The user's optimizer over ``groups``, checked to be one."""
    inner = builder(groups)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"the optimizer spec returned {type(inner).__name__}, not a torch.optim.Optimizer: "
                         "pass zr.AdamW(...) or a callable params -> torch.optim.Optimizer")
    return inner


def clip_(grad: torch.Tensor, max_grad_norm: Optional[float], norm: float) -> None:
    """Scale ``grad`` by the global norm's clip coefficient, as torch.nn.utils.clip_grad_norm_ does."""
    if max_grad_norm is not None:
        coef = max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            grad.mul_(coef)


def group_table(scalars: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Each param group's hyperparameters by group key, from an export's scalars (JSON form);
    a checkpoint from before the optimizer record carries each group's lr only."""
    table = scalars.get("groups")
    return table if table is not None else {key: {"lr": lr} for key, lr in scalars.get("group_lr", {}).items()}


def load_groups(groups: Sequence[Dict[str, Any]], keys: Sequence[str], scalars: Mapping[str, Any]) -> None:
    """Set the ``groups`` of a state_dict (``keys``: their group keys) to the exported hyperparameters."""
    table = group_table(scalars)
    for key, g in zip(keys, groups):
        g.update(decode_hyperparameters(table.get(key, {})))


def export_groups(scalars: Dict[str, Any], groups_by_key: Mapping[str, Mapping[str, Any]], scheduler: Any) -> None:
    """Every group's hyperparameters, as torch's state_dict() holds them, and the scheduler's state
    ([Note: optimizer record] in engine/optim_record.py), into an export's ``scalars``."""
    scalars["groups"] = {key: hyperparameters(g) for key, g in groups_by_key.items()}
    if scheduler is not None:
        scalars["scheduler"] = scheduler_state(scheduler)


def load_scheduler(scheduler: Any, scalars: Mapping[str, Any]) -> None:
    """The exported scheduler state into ``scheduler`` (after the groups: its last lrs are theirs)."""
    if scheduler is not None and scalars.get("scheduler") is not None:
        load_scheduler_state(scheduler, scalars["scheduler"])


def build_segments(spans: Sequence[Tuple[int, int, Dict[str, Any]]], total: int,
                   breaks: Sequence[int] = ()) -> List[Segment]:
    """Merge consecutive local spans with equal overrides; padding joins its neighbour. No
    segment crosses an offset in ``breaks`` (where a piece of the master starts)."""
    edges = [0, *sorted({b for b in breaks if 0 < b < total}), total]
    if len(edges) == 2:
        return _merge_spans(spans, total)
    segments: List[Segment] = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [(a - lo, b - lo, o) for a, b, o in spans if lo <= a < hi]
        segments += [Segment(s.start + lo, s.end + lo, s.overrides) for s in _merge_spans(inside, hi - lo)]
    return segments


def _merge_spans(spans: Sequence[Tuple[int, int, Dict[str, Any]]], total: int) -> List[Segment]:
    segments: List[Segment] = []
    for start, end, overrides in spans:
        key = tuple(sorted(overrides.items()))
        if segments and segments[-1].overrides == key:
            prev = segments[-1]
            segments[-1] = Segment(prev.start, end, key)
        elif segments:
            prev = segments[-1]
            segments[-1] = Segment(prev.start, start, prev.overrides)  # absorb padding gap
            segments.append(Segment(start, end, key))
        else:
            segments.append(Segment(0, end, key))
    if not segments:
        return [Segment(0, total, ())] if total else []
    last = segments[-1]
    segments[-1] = Segment(last.start, total, last.overrides)
    return segments


ROW = 256  # elements per row of squared_norm's reduction


def squared_norm(flat: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of a 1-D fp32 tensor, as a 0-dim fp64 tensor, to fp32 precision.

    ``torch.linalg.vector_norm`` (and ``torch.dot``) of one long fp32 tensor on the CPU
    accumulate in fp32 along the tensor and lose digits with its length: on 3.3M elements (the
    main job's gradient on one worker) 3.6e-4 relative, on 13M 1e-2, where torch's own
    ``clip_grad_norm_`` takes per-parameter norms and is exact to ~1e-7. Clipping multiplies
    every gradient by ``max_norm / norm``, so that error went into every clipped update, and
    differently at each worker count (shards of other lengths). So the norm is taken over rows
    of ``ROW`` elements (fp32 is exact enough over 256), and the rows' squares are summed in
    fp64: 5e-8 relative on 13M, no gradient-sized temporary (one value per row), and no slower
    than the one long reduction."""
    whole = flat.numel() // ROW * ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1).double().square().sum()
    rest = torch.linalg.vector_norm(flat[whole:]).double().square()
    return rows + rest


class ShardedOptimizer:
    """An inner torch optimizer over this rank's flat fp32 master, by segments ([Note: flat
    optimizer]), with global-norm clipping and an optional LR scheduler. ``param_spans``: the
    local [start, end) of each parameter this rank holds, by name, so that a parameter no rank
    used in a step can be skipped ([Note: unused parameters] in engine/flat_pieces.py)."""

    def __init__(self, spec: Any, master: Union[torch.Tensor, LocalShard, DiskMaster], grad: torch.Tensor,
                 segments: List[Segment], max_grad_norm: Optional[float],
                 scheduler_fn: Optional[Callable[[Any], Any]] = None,
                 param_spans: Optional[Mapping[str, Tuple[int, int]]] = None,
                 offload: Optional[DiskOffload] = None) -> None:
        # 1D fp32 each; a LocalShard master is viewed one segment at a time ([Note: local shard])
        self.master, self.grad, self.segments = master, grad, segments
        self.max_grad_norm = max_grad_norm
        self.pieces = FlatPieces(master, grad, [(seg.start, seg.end) for seg in segments], param_spans or {})
        # Whether a step has left a parameter unused, on any rank (so on every rank alike): the
        # pieces' per-element state may then differ, and is exported per element.
        self.uneven = False
        groups = [{"params": [p], **dict(seg.overrides)} for seg, p in zip(segments, self.pieces.params)]
        self.builder = spec.build if hasattr(spec, "build") else spec
        self.inner = build_inner(self.builder, groups)
        self.pieces.inner = self.inner
        self.scheduler = scheduler_fn(self.inner) if scheduler_fn is not None else None
        # in memory: one flat tensor per state key that the pieces' state tensors are views of
        self.flat_state = FlatState(master.numel())
        # the per-element state's home between steps when offloaded; None: inner.state (memory)
        self.disk: Optional[DiskStepper] = None
        on_disk = isinstance(master, DiskMaster)
        if on_disk and offload is None:
            raise ValueError("a master on disk (DiskMaster) needs the disk tier: pass offload=DiskOffload(...)")
        if offload is not None:
            self.disk = make_stepper(self.builder, [dict(seg.overrides) for seg in segments], offload.folder,
                                     offload.rank, master.numel(), offload.chunk_bytes,
                                     target=master.target if on_disk else None)
            if on_disk:
                master.attach(self.disk)  # the initial values move into the master file

    whole_params = False  # flat pieces ([Note: optimizer paths] in engine/optim_choice.py)

    def groups_by_key(self) -> Dict[str, Dict[str, Any]]:
        """Each torch param group by the key of its overrides (``Segment.key``): what a
        checkpoint records ([Note: optimizer record] in engine/optim_record.py)."""
        return {seg.key: g for seg, g in zip(self.segments, self.inner.param_groups)}

    @property
    def flat_params(self) -> List[torch.nn.Parameter]:
        """The flat parameters the inner optimizer steps (one per segment until a split)."""
        return self.pieces.params

    def param_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The inner optimizer's state of the piece holding this rank's part of parameter
        ``name``; None when it has none (torch keeps none for a parameter never updated) or
        this rank holds none of that parameter."""
        if name not in self.pieces.index:
            return None
        start = self.pieces.span_of(name)[0]
        piece = next(pc for pc in self.pieces.pieces if pc.start <= start < pc.end)
        if self.disk is not None:
            return self.disk.piece_state(self.inner, piece)
        return self.inner.state.get(piece.param)

    def local_sumsq(self) -> torch.Tensor:
        """Squared L2 norm of this rank's (already averaged) gradient, a 0-dim fp64 tensor; the
        engine sums it over ranks in the step's status all-reduce."""
        return squared_norm(self.grad)

    def state_tensors(self) -> List[torch.Tensor]:
        """The inner optimizer's state tensors (momentum, variance, ...) in memory, for memory
        reports; offloaded: the scalars and the disk tier's buffers."""
        held = [v for state in self.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return held + (self.disk.buffers() if self.disk is not None else [])

    def exchange_buffers(self) -> List[torch.Tensor]:
        """None: the flat pieces are the shard's own memory."""
        return []

    def step(self, norm: float, unused: Sequence[str] = ()) -> None:
        """Clip by the global norm (as torch.nn.utils.clip_grad_norm_ does) and update every
        parameter but ``unused``, those no rank produced a gradient for (the same list on every
        rank; [Note: unused parameters] in engine/flat_pieces.py)."""
        clip_(self.grad, self.max_grad_norm, norm)
        if unused:
            self.uneven = True
        with self.pieces.skipping(unused):
            if self.disk is not None:
                self.disk.step(self.inner, self.pieces.pieces)
            else:
                self.inner.step()
                # new state (the first update of a piece) or a tensor the optimizer replaced
                self.flat_state.rehome(self.inner, self.pieces.pieces)
        if self.scheduler is not None:
            self.scheduler.step()

    def skip(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def prefetch(self) -> None:
        """Offloaded: start reading the next step's first chunks of state (at the step's start, so
        that the reads run during forward and backward)."""
        if self.disk is not None:
            self.disk.prefetch(self.pieces.pieces)

    def offload_stats(self) -> Dict[str, float]:
        """The disk tier's I/O totals (offload/stepper.py's ``stats``); empty without one."""
        return self.disk.stats() if self.disk is not None else {}

    def close(self) -> None:
        """Remove the disk tier's scratch files, if any."""
        if self.disk is not None:
            self.disk.close()

    # --- state for checkpoints and resize: flat tensors over the local shard ----------------

    def export_state(self, live: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """``_export_state`` with the offloaded state read back for the export's duration."""
        if self.disk is None:
            return self._export_state(live)
        with self.disk.loaded(self.inner, self.pieces.pieces):
            return self._export_state(False)  # the loaded state goes back to the files after

    def _export_state(self, live: bool) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Every per-element state tensor as one flat tensor over the local shard ("optim.<key>";
        zeros where a piece has no state), and the scalar state: one value ("optim.<key>" in the
        scalars) while the pieces agree, else per element ([Note: per-element state]).

        A key kept in a flat ([Note: flat optimizer state] in engine/flat_state.py) is exported
        as a copy of that flat, or, ``live``, as the flat itself when it is fp32 on the CPU: the
        optimizer's own state, which the next update changes (the snapshot's use)."""
        tensors: Dict[str, torch.Tensor] = {}
        scalars: Dict[str, Any] = {}
        n = self.master.numel()
        pieces = self.pieces.pieces
        states = [self.inner.state.get(pc.param) or {} for pc in pieces]
        keys: Dict[str, None] = dict.fromkeys(k for state in states for k in state)
        probed = self._probe_stateless_groups() if self.uneven else {}
        keys.update(dict.fromkeys(probed))
        per_element: List[str] = []
        for k in keys:
            held = [(pc, state[k]) for pc, state in zip(pieces, states) if k in state]
            if held and all(isinstance(v, torch.Tensor) and v.shape == pc.param.shape for pc, v in held) \
                    or not held and probed[k]:
                flat = self.flat_state.flat_of(k, held) if held else None
                if flat is not None:
                    own = live and flat.dtype == torch.float32 and flat.device.type == "cpu"
                    tensors[f"optim.{k}"] = flat if own else flat.detach().to("cpu", torch.float32, copy=True)
                    continue
                covered = sum(pc.end - pc.start for pc, _ in held) == n  # no zeros to write
                flat = torch.empty(n, dtype=torch.float32) if covered else torch.zeros(n, dtype=torch.float32)
                for pc, v in held:
                    flat[pc.start:pc.end] = v.detach().float().cpu()
                tensors[f"optim.{k}"] = flat
            elif self.uneven and all(_is_number(v) for _, v in held):
                flat = torch.zeros(n, dtype=torch.float32)
                for pc, v in held:
                    flat[pc.start:pc.end] = float(v)
                tensors[f"optim.{k}"] = flat
                per_element.append(k)
            else:
                v = held[0][1] if held else None
                scalars[f"optim.{k}"] = float(v) if isinstance(v, (torch.Tensor, int, float)) else v
        if self.uneven:
            scalars["optim_per_element"] = per_element
        export_groups(scalars, self.groups_by_key(), self.scheduler)
        return tensors, scalars

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load what ``export_state`` produced (possibly resharded), through ``load_state_dict``.

        [Note: state placement]
        Each state tensor must end up where torch itself puts it, or the next ``step`` fails
        on a GPU: ``step`` stays a CPU float32 scalar unless the group is fused or capturable,
        then it goes to the parameter's device (fused Adam on CUDA refuses a CPU ``step``);
        every other tensor goes to the parameter's device and, the parameter being floating,
        its dtype. ``Optimizer.load_state_dict`` applies exactly that policy (and whatever an
        optimizer subclass changes in it), so the state is handed to it in CPU form instead of
        being written into ``inner.state`` by hand. Restore and resize both come through here.

        [Note: per-element state]
        Once a step has left a parameter unused ([Note: unused parameters] in engine/flat_pieces.py),
        the pieces' scalar state (Adam's ``step``) may differ, and a piece may have no state at
        all (a parameter never used: torch keeps none for it). Every rank then exports each
        scalar state per element, as a flat fp32 tensor like the others ("optim.step"), named
        in the scalars' ``optim_per_element``; whether a rank does is decided by the step
        status, which all ranks share, so every rank writes the same keys. The flat tensors
        reshard by the same range math as ``exp_avg`` ([Note: resharding]), padding arriving
        as zero. An import cuts the segments between neighbouring parameters whose scalar
        state differs, or whose state is present in one and not the other, and leaves the
        pieces without state stateless. A parameter has state when one of its values is
        non-zero: ``step`` counts from 1 once a parameter was updated; an optimizer without
        scalar state (SGD) has all-zero state only for a parameter it never updated, or one
        whose every gradient was exactly zero, whose next update is then the same unless
        SGD's dampening is set. A rank none of whose parameters in a param group was ever
        updated has no state there to read the keys from, so it learns them from a probe
        (``_probe_stateless_groups``), and writes zeros. A checkpoint from before (or from a
        run where every parameter was always used) has one scalar per key, and every piece
        gets it.
        """
        whole = [k for k in tensors if is_owned_key(k)]
        if whole or scalars.get("optim_path") is not None:
            raise ValueError(
                f"the checkpoint holds the state of an optimizer stepped on whole parameters ({', '.join(whole[:3])}), "
                "but this one is element-wise and runs on flat pieces: restore it with the optimizer it was saved with, "
                "or pass fresh_optimizer=True to restore to start the optimizer's state fresh")
        per_element = scalars.get("optim_per_element")
        flats = {name[6:]: flat for name, flat in tensors.items() if name.startswith("optim.")}
        self.pieces.reset()
        self.flat_state.clear()  # the pieces' state is replaced; the next update re-homes it
        signature = None
        if per_element is not None:
            signature = self._piece_signature(flats, per_element)
            self.pieces.split(self.pieces.cuts_between(signature))
        sd = self.inner.state_dict()
        index = {id(p): i for g, sg in zip(self.inner.param_groups, sd["param_groups"])
                 for p, i in zip(g["params"], sg["params"])}
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for pc in self.pieces.pieces:
            entry = {}
            if signature is not None:
                names = self.pieces.params_in(pc)
                held, values = signature(*self.pieces.span_of(names[0])) if names else (False, ())
                if not held:
                    continue  # a piece torch never updated: no state, as torch keeps none
                entry.update({k: torch.tensor(v, dtype=torch.float32) for k, v in zip(per_element, values)})
            for name, flat in flats.items():
                if signature is None or name not in per_element:
                    # clone: load_state_dict's .to() is a no-op on a CPU run and would alias the caller's flat
                    entry[name] = flat[pc.start:pc.end].clone()
            for name, value in scalars.items():
                if name.startswith("optim.") and value is not None:
                    # float32 on the CPU is how torch.optim creates a non-capturable step
                    entry[name[6:]] = torch.tensor(float(value), dtype=torch.float32)
            if entry:
                state[index[id(pc.param)]] = entry
        sd["state"] = state
        load_groups(sd["param_groups"], [seg.key for seg in self.segments], scalars)
        self.inner.load_state_dict(sd)
        if self.disk is not None:
            self.disk.spill(self.inner, self.pieces.pieces)
        self.uneven = per_element is not None
        load_scheduler(self.scheduler, scalars)

    def _probe_stateless_groups(self) -> Dict[str, bool]:
        """The state keys (-> whether per element) of the param groups none of whose pieces has
        state here yet (their parameters never updated), so that this rank exports the keys its
        peers do ([Note: per-element state]): torch creates state lazily, so they are learnt from
        a one-element probe parameter stepped by an optimizer the spec builds for that group."""
        keys: Dict[str, bool] = {}
        for group, seg in zip(self.inner.param_groups, self.segments):
            if any(self.inner.state.get(p) for p in group["params"]):
                continue
            probe = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=self.grad.device))
            probe.grad = torch.zeros_like(probe)
            optimizer = self.builder([{"params": [probe], **dict(seg.overrides)}])
            optimizer.step()
            for k, v in optimizer.state.get(probe, {}).items():
                keys[k] = isinstance(v, torch.Tensor) and v.shape == probe.shape
        return keys

    @staticmethod
    def _piece_signature(flats: Dict[str, torch.Tensor], per_element: Sequence[str]
                         ) -> Callable[[int, int], Tuple[bool, Tuple[float, ...]]]:
        """(has state, its per-element scalar values) of the parameter at local [start, end) in
        imported flat state; see [Note: per-element state]."""
        def signature(start: int, end: int) -> Tuple[bool, Tuple[float, ...]]:
            values = tuple(float(flats[k][start]) for k in per_element)
            if per_element:
                held = any(v != 0 for v in values)
            else:
                held = any(bool(flat[start:end].any()) for flat in flats.values())
            return (held, values) if held else (False, ())
        return signature


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)
