"""The engine's storage of one stage family: the units, the fp32 master, the fp32 gradient, the
local parameter shard and its gatherer, and everything that depends on where they live.

[Note: stage data flow]
Tensors per rank (Φ trainable elements, W workers, "shard" = ``layout.shard_numel``):

stage | full params (compute dtype)     | local param shard          | fp32 grad    | fp32 master + optimizer
0     | persistent arena                | -                          | full         | full
1, 2  | persistent arena                | the arena's rows (no copy) | shard        | shard
3     | per unit, gathered on demand    | shard                      | shard        | shard

At stages 1-2 the local shard is this rank's rows of the arena ([Note: local shard] in
layout/local_shard.py): the gather source, updated in place. In fp32 the master is the parameter
tensor itself (those rows at stages 1-2, the local shard at stage 3, the arena at stage 0):
no copy; in mixed precision it is a contiguous fp32 shard. Gradients leave autograd
through a post-accumulate hook and go straight into the coalescing buckets
(comm/buckets.py), which all-reduce (stage 0) or reduce-scatter (stages 1-3) them into the
fp32 gradient. Stages 0 and 1 with gradient accumulation let autograd accumulate full
gradients locally and reduce once, on the last micro-batch (also those of parameters that
micro-batch did not use); stages 2 and 3 reduce-scatter
every micro-batch into the fp32 shard, so the accumulated gradient only ever exists as the
owner's shard ([Note: stage policy]).

Two families, chosen once by ``build_storage``; the engine asks the storage and never tests
the stage:

- ``ReplicatedStorage`` (stage 0): master and gradient full-size, in full coordinates; no
  parameter shard, no gatherer. Checkpoints hold every stage in shard coordinates, so its
  state conversions cut this rank's shard out of the full tensors (export) and lay a
  world-size-1 shard back out in full coordinates (import).
- ``ShardedStorage`` (stages 1-3): master and gradient in this rank's shard coordinates, the
  checkpoint's own; the parameter shard is the arena's rows (stages 1-2, whose publish then
  gathers the units from them) or a shard of its own (stage 3, gathered on demand).

With ``offload="disk"`` in mixed precision the master is a ``DiskMaster`` (offload/master.py):
its values live in the disk tier's files, the optimizer step casts each updated chunk into the
parameter memory itself, and the publish casts nothing ([Note: master on disk]). At stage 3
the parameter shard is in a file too, a ``DiskShard`` the gatherer reads ahead of each gather,
and so, in every dtype, is the master ([Note: parameter shard on disk] in offload/shard.py).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Group
from zeroray.engine.initial_values import Kept, initial_full, initial_shard
from zeroray.fetch.unit import Units
from zeroray.layout.arena import FlatLayout
from zeroray.layout.local_shard import LocalShard
from zeroray.layout.stage import StagePolicy
from zeroray.memory.process import MappedBlocks, fix_heap_ceiling
from zeroray.memory.unit_pool import UnitPool
from zeroray.offload.master import DiskMaster
from zeroray.offload.shard import DiskShard

Master = Union[LocalShard, DiskMaster]  # in memory, or in the disk tier's files ([Note: master on disk])
ParamShard = Union[LocalShard, DiskShard]  # stage 3: in memory, or in a file ([Note: parameter shard on disk])


class ReplicatedStorage:
    """Stage 0: the full fp32 master (the arena itself in fp32) and the full fp32 gradient."""

    param_shard: Optional[LocalShard] = None
    gatherer: Optional[UnitGatherer] = None

    def __init__(self, layout: FlatLayout, units: Units, rank: int, init: Optional[torch.Tensor] = None,
                 master_on_disk: bool = False) -> None:
        """``init``: in mixed precision, the fp32 initial values in full coordinates (the master's
        start; the arena holds them rounded to the compute dtype)."""
        self.layout, self.units, self.rank = layout, units, rank
        arena = units.arena
        copy = arena.dtype != torch.float32  # the master is a copy of its own
        assert init is not None or not copy, "mixed precision starts the master from the fp32 values"
        self.master: Master = (DiskMaster(init, LocalShard.contiguous(arena)) if copy and master_on_disk
                               else LocalShard.contiguous(init if copy else arena))  # 1D full fp32
        # publishing casts the master into the arena; on disk the step has cast each chunk already
        self.cast = copy and not master_on_disk
        self.grad = torch.zeros(layout.full_numel, dtype=torch.float32, device=arena.device)  # 1D full
        # Every rank holds the same full reduced gradient: only rank 0 counts it in the global norm.
        self.counts_norm = rank == 0

    def param_spans(self) -> Dict[str, Tuple[int, int]]:
        """[start, end) of each parameter's piece in the master, in order: all of each one."""
        spans = {}
        for name in self.layout.param_names:
            start = self._full_start(name)
            spans[name] = (start, start + self.layout.slots[name].numel)
        return spans

    # Every rank holds every parameter whole: the whole-parameter optimizer steps them in place.
    holds_whole_params = True

    def param_piece(self, name: str) -> Tuple[int, int, int]:
        """(start, lo, hi): the master holds parameter ``name``'s flat elements [lo, hi) from
        offset ``start``: all of them, in full coordinates."""
        return self._full_start(name), 0, self.layout.slots[name].numel

    def master_piece(self, name: str) -> Tuple[int, int, torch.Tensor]:
        """(lo, hi, fp32 values) of parameter ``name``'s flat elements this rank reports: rank 0
        all of them, the others none (they hold the same)."""
        if self.rank != 0:
            return 0, 0, torch.empty(0)
        start, numel = self._full_start(name), self.layout.slots[name].numel
        return 0, numel, self.master.read(start, start + numel).detach().cpu().clone()

    def master_shard(self, live: bool = False) -> torch.Tensor:
        """The fp32 master in this rank's shard coordinates (on the CPU): always a copy here, the
        full master is not in those coordinates."""
        return self.to_shard(self.master.read(0, self.master.numel()).detach())

    def to_shard(self, full: torch.Tensor) -> torch.Tensor:
        """A full-size tensor cut to this rank's shard coordinates, those of every checkpoint."""
        out = torch.zeros(self.layout.shard_numel, dtype=torch.float32)
        for unit in self.layout.units:
            lo, hi = unit.rank_range(self.rank)
            out[unit.shard_offset:unit.shard_offset + hi - lo] = full[unit.full_offset + lo:unit.full_offset + hi].cpu()
        return out

    def exported(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The optimizer's flat tensors in shard coordinates."""
        return {k: self.to_shard(v) for k, v in tensors.items()}

    def state_layout(self) -> Tuple[FlatLayout, int]:
        """The (layout, rank) whose shard coordinates ``imported`` takes: everything, as one rank."""
        return self.layout.with_world_size(1), 0

    def imported(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Tensors in ``state_layout()`` coordinates laid out in the master's full coordinates."""
        single = self.layout.with_world_size(1)
        full = {}
        for key, flat in tensors.items():
            out = torch.zeros(self.layout.full_numel, dtype=torch.float32)
            for unit, one in zip(self.layout.units, single.units):
                out[unit.full_offset:unit.full_offset + unit.numel] = flat[one.shard_offset:one.shard_offset + one.numel]
            full[key] = out
        return full

    def publish(self, coordinator) -> None:
        """Make the updated master visible to compute: in mixed precision, cast into the arena."""
        if self.cast:
            with torch.no_grad():
                self.units.arena.copy_(self.master.as_tensor())

    def close(self) -> None:
        """Nothing of its own on disk (the optimizer closes the master's files)."""

    def offload_stats(self) -> Dict[str, float]:
        """No parameter shard, none on disk."""
        return {}

    def _full_start(self, name: str) -> int:
        slot = self.layout.slots[name]
        return self.layout.units[slot.unit].full_offset + slot.offset


class ShardedStorage:
    """Stages 1-3: the fp32 master and gradient of this rank's shard, and the parameter shard
    the units are gathered from (``gatherer``). ``publish_gathers``: a publish starts gathering
    every unit (stages 1-2, whose units persist); stage 3 gathers each where it is needed."""

    counts_norm = True  # each rank's gradient shard is its own part of the norm

    def __init__(self, layout: FlatLayout, units: Units, rank: int, master: Master, param_shard: ParamShard,
                 gatherer: UnitGatherer, *, publish_gathers: bool) -> None:
        self.layout, self.units, self.rank = layout, units, rank
        self.master, self.param_shard, self.gatherer = master, param_shard, gatherer
        # mixed precision: the parameter shard is a cast copy, cast by the publish (by the step
        # itself, chunk by chunk, when the master is on disk)
        self.cast = param_shard is not master and not isinstance(master, DiskMaster)
        self.publish_gathers = publish_gathers
        self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=master.device)  # 1D shard

    def param_spans(self) -> Dict[str, Tuple[int, int]]:
        """[start, end) of each parameter's piece in the master, in order (the pieces this rank holds)."""
        spans = {}
        for name in self.layout.param_names:
            start, lo, hi = self.layout.param_shard_range(name, self.rank)
            if hi > lo:
                spans[name] = (start, start + hi - lo)
        return spans

    @property
    def holds_whole_params(self) -> bool:
        """Whether this rank's shard holds every parameter whole (one worker)."""
        return self.layout.world_size == 1

    def param_piece(self, name: str) -> Tuple[int, int, int]:
        """(start, lo, hi): the master holds parameter ``name``'s flat elements [lo, hi) (possibly
        none) from offset ``start`` of this rank's shard."""
        return self.layout.param_shard_range(name, self.rank)

    def master_piece(self, name: str) -> Tuple[int, int, torch.Tensor]:
        """(lo, hi, fp32 values) of parameter ``name``'s flat elements held by this rank."""
        start, lo, hi = self.layout.param_shard_range(name, self.rank)
        return lo, hi, self.master.read(start, start + hi - lo).detach().cpu().clone()

    def master_shard(self, live: bool = False) -> torch.Tensor:
        """The fp32 master in this rank's shard coordinates (on the CPU): a copy, or, ``live``,
        the master tensor itself where it is one tensor in memory on the CPU (stage 3, and mixed
        precision); at stages 1-2 in fp32 it is the arena's rows, and a copy joins them."""
        if live and isinstance(self.master, LocalShard) and self.master.is_contiguous_tensor \
                and self.master.device.type == "cpu":
            return self.master.as_tensor().detach()
        return self.master.cpu()

    def exported(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The optimizer's flat tensors, already in shard coordinates."""
        return tensors

    def state_layout(self) -> Tuple[FlatLayout, int]:
        """The (layout, rank) whose shard coordinates ``imported`` takes: this rank's own."""
        return self.layout, self.rank

    def imported(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return tensors

    def publish(self, coordinator) -> None:
        """Make the updated master visible to compute: cast it into the parameter shard (mixed
        precision) and, at stages 1-2, start the gathers ([Note: deferred publish] in
        fetch/publish.py)."""
        with torch.no_grad():
            if self.cast:
                self.param_shard.copy_(self.master)
            if self.publish_gathers:
                coordinator.publish()

    def close(self) -> None:
        """Remove the parameter shard's scratch file, when it is on disk."""
        if isinstance(self.param_shard, DiskShard):
            self.param_shard.close()

    def offload_stats(self) -> Dict[str, float]:
        """The parameter shard's I/O totals when it is on disk (``DiskShard.stats``), else none."""
        return self.param_shard.stats() if isinstance(self.param_shard, DiskShard) else {}


Storage = Union[ReplicatedStorage, ShardedStorage]  # the two families; build_storage picks one


def build_storage(policy: StagePolicy, layout: FlatLayout, named: Dict[str, torch.nn.Parameter], kept: Kept,
                  group: Group, *, dtype: torch.dtype, device: torch.device, bucket_bytes: int,
                  wait: Callable, master_on_disk: bool = False, offload_dir: Optional[str] = None) -> Storage:
    """The units (the model's parameters bound to their buffers) and the storage of ``policy``'s
    family; every tensor the step needs that the optimizer does not allocate itself. ``kept``:
    the slices a sharded build kept (construct/sharded_init.py), else None. ``wait``: the
    engine's polling waiter, for the gatherer. ``master_on_disk``: offload="disk", which puts a
    master that is a copy (mixed precision) in the disk tier ([Note: master on disk] in
    offload/master.py; the optimizer attaches it to its files), and at stage 3 the parameter
    shard in a file under ``offload_dir`` with it, in every dtype ([Note: parameter shard on
    disk] in offload/shard.py)."""
    fp32, rank = dtype == torch.float32, group.rank
    # The fp32 initial values of the rank's shard, taken before bind rebinds the parameters:
    # the master of stage 3 and of mixed precision at stages 0-2 (stage 0: all of them, in full
    # coordinates). fp32 stages 0-2 need none, their master is the arena itself or its rows
    # ([Note: local shard] in layout/local_shard.py).
    init = None
    if policy.reshard_after_use or (policy.keeps_param_shard and not fp32):
        init = initial_shard(layout, named, kept, rank, device)
    elif not fp32:
        init = initial_full(layout, named, device)
    # Stage 3 on CPU: unit buffers are the pool's mappings, off the heap ([Note: unit pool] in
    # memory/unit_pool.py), and the heap is left as at stages 0-2 ([Note: process memory] in
    # memory/process.py); a parameter shard on disk keeps its slices as mappings of their own.
    cpu = torch.device(device).type == "cpu"
    pool = UnitPool() if policy.reshard_after_use and cpu else None
    mapped = MappedBlocks().mapped if pool is not None and master_on_disk else None
    if cpu and mapped is None:
        fix_heap_ceiling()
    units = Units(layout, dtype, device, persistent=not policy.reshard_after_use, pool=pool)
    units.bind(named, copy_values=kept is None)
    if not policy.keeps_param_shard:
        return ReplicatedStorage(layout, units, rank, init, master_on_disk)
    if not policy.reshard_after_use:  # stages 1-2: the shard is the arena's rows
        param_shard = LocalShard.arena_rows(layout, units.arena, rank)
        master = param_shard if fp32 else LocalShard.contiguous(init)
    elif master_on_disk:  # stage 3, offloaded: the shard in a file, and so the master too
        param_shard = DiskShard(init.to(dtype), offload_dir, rank, mapped=mapped)
        master = DiskMaster(init, param_shard)
    else:  # stage 3: a shard of its own
        master = LocalShard.contiguous(init)
        param_shard = master if fp32 else LocalShard.contiguous(init.to(dtype))
    if not fp32 and master_on_disk and not isinstance(master, DiskMaster):
        master = DiskMaster(init, param_shard)
    gatherer = UnitGatherer(layout, group, param_shard, bucket_bytes, wait=wait)
    return ShardedStorage(layout, units, rank, master, param_shard, gatherer,
                          publish_gathers=not policy.reshard_after_use)
