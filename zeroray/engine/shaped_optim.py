"""The whole-parameter optimizer: any torch optimizer, stepping each parameter whole, with its real
shape, on the rank that owns it; the state still sharded at stages 1-3.

[Note: whole-parameter optimizer]
An optimizer that reads a parameter's shape or takes a statistic over a whole tensor (Adafactor
factors a matrix's second moment by rows and columns, Muon orthogonalises each 2-D update,
LAMB and LARS scale by a per-tensor trust ratio, Shampoo keeps per-dimension preconditioners)
computes something else on the flat pieces of a shard ([Note: flat optimizer] in engine/optim.py).
zeroray gives it what single-process torch gives it: one ``nn.Parameter`` per trainable
parameter, of the parameter's shape, stepped with the whole parameter's gradient. The design is
torch's ZeroRedundancyOptimizer and Distributed Muon's: at stages 1-3 each parameter has one
owner ([Note: parameter owners] in layout/owners.py), which holds all of its optimizer state and
steps it; the gradient (reduced and clipped as on the flat path) and the fp32 master reach the
owner and the update comes back in chunks ([Note: whole-parameter exchange] in
engine/param_exchange.py). At stage 0 and with one worker every rank holds every parameter
whole and steps them all, as torch DDP steps its replicas.

The parameters it hands the optimizer persist for the engine's life: their ``.data`` and
``.grad`` point at the chunk's shaped buffers (or straight at the master and gradient when they
are held whole in memory), so the optimizer's state, keyed by parameter as torch keys it, lives
on. The param groups are one per distinct ``param_groups`` override set, in the order of their
first parameter, the same on every rank, each holding the parameters this rank owns as
``(name, parameter)`` pairs (so a recipe may choose by name or by ``ndim``; torch's
``param_names``); a group may be empty on a rank (torch accepts that), and so may all of them.
The spec is called once with these groups. A step calls the optimizer once per chunk holding
parameters of this rank, the other parameters having no gradient for that call, and at least
once a step: the same update as one call over all of them for any optimizer that updates each
parameter from its own gradient and state (every torch optimizer does; a parameter without a
gradient is skipped, as torch skips it). An optimizer that couples parameters across tensors
in one call (a global norm over all of them, L-BFGS) would see only a chunk: zeroray does not
support it. A parameter no rank used in the step ([Note: unused parameters] in
engine/flat_pieces.py) gets no gradient, so the optimizer skips it.

State: exported per parameter by its owner (at stage 0, the rank the owner map names), each
state tensor whole under "param_state/<name>/<key>" and each number as a 0-dim tensor under
"param_number/<name>/<key>" (layout/owners.py), loaded back through ``load_state_dict``
([Note: state placement] in engine/optim.py) by whichever rank owns the parameter then.
Checkpoints, resizes and snapshots route them by the owner map of the layout they go to.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from zeroray.comm.group import Group
from zeroray.engine.optim import (DiskOffload, build_inner, clip_, export_groups, load_groups, load_scheduler,
                                  squared_norm)
from zeroray.engine.optim_record import group_key
from zeroray.engine.param_exchange import ParamExchange, owned_names
from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import imbalance, is_owned_key, owned_key, param_owners, split_owned_key
from zeroray.offload.master import DiskMaster
from zeroray.offload.param_state import ParamStateFile
from zeroray.offload.stepper import MASTER, DiskStepper
from zeroray.offload.shard import DiskShard
from zeroray.offload.tier import StateFiles

PATH = "whole_params"  # scalars["optim_path"] of an export: which path's state it is


class WholeParamOptimizer:
    """An inner torch optimizer over whole, shaped parameters, each stepped by its owner; see
    [Note: whole-parameter optimizer]. ``overrides[name]``: what ``param_groups`` overrides for
    every trainable parameter; ``chunk_bytes``: the exchange's send buffer (None: one chunk where
    nothing moves)."""

    def __init__(self, spec: Any, storage: Any, layout: FlatLayout, overrides: Mapping[str, Dict[str, Any]],
                 group: Group, max_grad_norm: Optional[float], chunk_bytes: int,
                 scheduler_fn: Optional[Callable[[Any], Any]] = None, offload: Optional[DiskOffload] = None) -> None:
        self.master, self.grad, self.layout = storage.master, storage.grad, layout
        self.rank, self.max_grad_norm = group.rank, max_grad_norm
        self.names = set(layout.param_names)
        self.owners = param_owners(layout)  # who exports each parameter's state (and steps it at stages 1-3)
        whole_here = storage.holds_whole_params
        held = layout.param_names if whole_here else [n for n in layout.param_names if self.owners[n] == self.rank]
        on_disk = isinstance(self.master, DiskMaster)
        if on_disk and offload is None:
            raise ValueError("a master on disk (DiskMaster) needs the disk tier: pass offload=DiskOffload(...)")
        device = self.grad.device
        # zero-memory placeholders of the real shapes, between the steps that give them a chunk's buffers
        self.placeholders = {n: torch.zeros((), device=device).expand(layout.slots[n].shape) for n in held}
        self.params = {n: torch.nn.Parameter(self.placeholders[n]) for n in held}
        pieces = {n: storage.param_piece(n) for n in layout.param_names}
        direct = whole_here and not on_disk
        self.exchange = ParamExchange(
            layout, pieces, self.master, self.grad, {n: 0 for n in held} if whole_here else self.owners,
            None if whole_here else group, chunk_bytes if offload is not None or not whole_here else None,
            direct=direct)
        if direct:  # views of the master, for good: the update lands in place (a gradient only in its chunk's call)
            for chunk in self.exchange.chunks:
                for name, (values, _) in self.exchange.bring(chunk).items():
                    self.params[name].data = values
        key_of = {n: group_key(overrides[n]) for n in layout.param_names}
        self.group_keys = list(dict.fromkeys(key_of[n] for n in layout.param_names))
        first = {k: overrides[n] for n, k in reversed(list(key_of.items()))}
        groups = []
        for k in self.group_keys:
            members = [n for n in held if key_of[n] == k]
            # named, so that a recipe can choose by name; an empty group says so too (torch wants
            # every group with names or none)
            groups.append({"params": [(n, self.params[n]) for n in members], **first[k],
                           **({} if members else {"param_names": []})})
        self.builder = spec.build if hasattr(spec, "build") else spec
        self.inner = build_inner(self.builder, groups)
        self.scheduler = scheduler_fn(self.inner) if scheduler_fn is not None else None
        self.disk: Optional[ParamStateFile] = None
        self.master_files: Optional[DiskStepper] = None
        if offload is not None:
            self.disk = ParamStateFile(offload.folder, offload.rank)
            if on_disk:
                self.master_files = _master_files(offload, self.master)
                self.master.attach(self.master_files)  # the initial values move into the master's file
        self._ahead: Tuple[Tuple[str, ...], Any] = ((), None)  # the state read ahead for the next chunk

    whole_params = True

    # --- what the engine asks of an optimizer -----------------------------------------------

    @property
    def held(self) -> List[str]:
        """The parameters this rank steps (all of them where it holds them whole)."""
        return list(self.params)

    def local_sumsq(self) -> torch.Tensor:
        """Squared L2 norm of this rank's (already averaged) gradient, a 0-dim fp64 tensor, as on
        the flat path (engine/optim.py's ``squared_norm``)."""
        return squared_norm(self.grad)

    def step(self, norm: float, unused: Sequence[str] = ()) -> None:
        """Clip by the global norm and update every parameter but ``unused`` (those no rank
        produced a gradient for: the same list on every rank), chunk by chunk."""
        clip_(self.grad, self.max_grad_norm, norm)
        skip = set(unused)
        stepped = False
        chunks = self.exchange.chunks
        self.exchange.allocate()
        try:
            for i, chunk in enumerate(chunks):
                views = self.exchange.bring(chunk)
                for name, (values, grad) in views.items():
                    param = self.params[name]
                    param.data = values
                    param.grad = None if name in skip else grad
                upcoming = self._stepped(chunks[i + 1], skip) if i + 1 < len(chunks) else []
                try:
                    stepped |= self._update([n for n in views if n not in skip], upcoming)
                finally:
                    for name in views:
                        self.params[name].grad = None  # no other chunk's call steps it
                        if not self.exchange.direct:  # the buffers go after the step
                            self.params[name].data = self.placeholders[name]
                self.exchange.send_back(chunk)
        finally:
            self.exchange.release()
        if not stepped:
            # every rank's optimizer steps every step (an LR scheduler expects it): nothing has a gradient
            self.inner.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _stepped(self, chunk: Any, skip: set) -> List[str]:
        return [n for n in owned_names(chunk, self.exchange.rank) if n not in skip]

    def _update(self, names: List[str], upcoming: List[str]) -> bool:
        """One call of the optimizer over ``names`` (their state read in from disk and written
        back when it is there); starts reading ``upcoming``'s state ahead."""
        if not names:
            return False
        if self.disk is not None:
            ahead_names, ahead = self._ahead
            fetched = ahead if ahead_names == tuple(names) else self.disk.fetch(names)
            self._ahead = (tuple(upcoming), self.disk.fetch(upcoming) if upcoming else None)
            for name, state in self.disk.take(fetched).items():
                self.inner.state[self.params[name]].update(state)
        self.inner.step()
        if self.disk is not None:
            for name in names:
                state = self.inner.state.get(self.params[name])
                if state:
                    self.disk.put(name, state)
        return True

    def skip(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def prefetch(self) -> None:
        """Offloaded: start reading the first chunk's state (during forward and backward)."""
        if self.disk is not None and self.exchange.chunks:
            names = owned_names(self.exchange.chunks[0], self.exchange.rank)
            self._ahead = (tuple(names), self.disk.fetch(names))

    def param_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The optimizer's state of parameter ``name`` (whole, its real shapes) where this rank
        holds it, else None (not held here, or no state yet: torch makes it on the first update)."""
        param = self.params.get(name)
        if param is None or not self.inner.state.get(param) and not (self.disk and self.disk.holds(name)):
            return None
        state = dict(self.inner.state.get(param, {}))
        if self.disk is not None:
            state.update(self.disk.read_now(name))
        return state

    def state_tensors(self) -> List[torch.Tensor]:
        """The optimizer's state tensors in memory (offloaded: the scalars), for memory reports."""
        return [v for state in self.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def share(self) -> Dict[str, Any]:
        """What this rank steps (parameters, elements) against a balanced share of the elements,
        and the owner map's imbalance over all ranks (1.0 where every rank steps everything)."""
        whole_here = self.exchange.group is None
        held = sum(self.layout.slots[n].numel for n in self.params)
        return {"held_params": len(self.params), "held_numel": held,
                "balanced_numel": self.layout.numel if whole_here else self.layout.numel / self.layout.world_size,
                "owner_imbalance": 1.0 if whole_here else imbalance(self.layout),
                "exchange_step_bytes": self.exchange.step_bytes}

    def exchange_buffers(self) -> List[torch.Tensor]:
        """The exchange's buffers now: none between steps (for memory reports)."""
        return self.exchange.buffers()

    def offload_stats(self) -> Dict[str, float]:
        """The disk tier's I/O totals; empty without one."""
        return self.disk.stats() if self.disk is not None else {}

    def close(self) -> None:
        """Remove the disk tier's scratch files, if any."""
        if self.disk is not None:
            self.disk.close()
        if self.master_files is not None:
            self.master_files.close()

    # --- state for checkpoints, resizes and snapshots: per parameter, by name ----------------

    def groups_by_key(self) -> Dict[str, Dict[str, Any]]:
        """Each torch param group by the key of its overrides: what a checkpoint records ([Note:
        optimizer record] in engine/optim_record.py). Every rank has every group (some empty)."""
        return dict(zip(self.group_keys, self.inner.param_groups))

    def exported_params(self) -> List[str]:
        """The parameters whose state this rank exports: those the owner map gives it."""
        return [n for n in self.params if self.owners[n] == self.rank]

    def export_state(self, live: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Each exported parameter's state, whole: tensors (copies, or, ``live``, the optimizer's
        own where they are on the CPU: the snapshot's use, which the next update waits for) and
        numbers as 0-dim tensors; the scalars say which path's state it is, with every group's
        hyperparameters and the scheduler's state, as the flat path exports them."""
        tensors: Dict[str, torch.Tensor] = {}
        for name in self.exported_params():
            state = self.param_state(name) or {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    own = live and value.device.type == "cpu" and not (self.disk and value.dim() > 0)
                    tensors[owned_key(name, key)] = value.detach() if own else value.detach().to("cpu", copy=True)
                elif isinstance(value, (bool, int, float)):
                    tensors[owned_key(name, key, number=True)] = torch.tensor(value)
                else:
                    raise ValueError(f"the optimizer keeps state {key!r} of parameter {name!r} as a "
                                     f"{type(value).__name__}; zeroray saves tensors and numbers only")
        scalars: Dict[str, Any] = {"optim_path": PATH}
        export_groups(scalars, self.groups_by_key(), self.scheduler)
        return tensors, scalars

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load the state of the parameters this rank holds from what ``export_state`` produced on
        the ranks that owned them ([Note: state placement] in engine/optim.py)."""
        flat = [k for k in [*tensors, *scalars] if k.startswith("optim.")]
        if flat:
            raise ValueError(
                "the checkpoint holds the optimizer state of an element-wise optimizer stepped on flat pieces "
                f"({', '.join(flat[:3])}), but this optimizer takes the whole-parameter path: restore it with the "
                "optimizer it was saved with (or declare this one element-wise with zr.elementwise if it is), or pass "
                "fresh_optimizer=True to restore to start the optimizer's state fresh")
        entries: Dict[str, Dict[str, Any]] = {}
        for k, value in tensors.items():
            if not is_owned_key(k):
                continue
            name, key, number = split_owned_key(k, self.names)
            if name not in self.params:
                raise RuntimeError(f"rank {self.rank} was given the state of {name!r}, which it does not hold")
            # clone: load_state_dict's .to() is a no-op on a CPU run and would alias the caller's tensor
            entries.setdefault(name, {})[key] = value.item() if number else value.clone()
        self._ahead = ((), None)
        if self.disk is not None:
            self.disk.drop()
        sd = self.inner.state_dict()
        index = {id(p): i for g, sg in zip(self.inner.param_groups, sd["param_groups"])
                 for p, i in zip(g["params"], sg["params"])}
        sd["state"] = {index[id(self.params[name])]: entry for name, entry in entries.items()}
        load_groups(sd["param_groups"], self.group_keys, scalars)
        self.inner.load_state_dict(sd)
        if self.disk is not None:
            for name in entries:
                self.disk.put(name, self.inner.state[self.params[name]])
        load_scheduler(self.scheduler, scalars)


def _master_files(offload: DiskOffload, master: DiskMaster) -> DiskStepper:
    """The disk tier's file of the fp32 master (none of its own in fp32 at stage 3, where the
    parameter shard's file holds it: [Note: parameter shard on disk] in offload/shard.py), as the
    master reads and writes it ([Note: master on disk] in offload/master.py); no state files."""
    shared = isinstance(master.target, DiskShard) and master.target.dtype == torch.float32
    files = StateFiles(offload.folder, offload.rank, master.numel(), [] if shared else [MASTER])
    return DiskStepper(files, 1, target=master.target)
