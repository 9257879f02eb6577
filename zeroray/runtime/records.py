"""What crosses the actor boundary between the driver and a worker: typed, frozen records.

Ray pickles each of these whole. The driver builds a ``WorkerSpec`` once per trainer and every
worker builds its engine from it (``Worker.setup``), answering with a ``SetupInfo``; every
step answers with a ``StepRecord`` (``Worker.train_step``, ``Worker.train_next``): the
engine's own ``StepStats`` with the hops it passed, which the driver combines into the
``StepResult`` (execution/pipeline.py), and attaching a Ray Data split with a ``SplitInfo``. The polls
answer ``NodeInfo`` and ``WorkerProgress``; the reports ``CommReport`` and ``MemoryReport``; a
snapshot's small per-rank record is a ``SnapshotRecord``, and every recovery of a fit leaves a
``RecoveryRecord`` in ``trainer.recoveries``. A ``FlatLayout`` crosses as itself. Checkpoint
manifests have their own typed fields (``ManifestFields``, ``Manifest`` in
checkpoint/manifest.py): those are a file format, not a message.

[Note: records read as mappings]
The records users see (``trainer.workers``, ``comm_report()``, ``memory_report()``,
``trainer.recoveries``, and the ``progress`` poll that tests and tools read) were dicts before
they were typed, and the README shows them read as ``rec["redone_steps"]``. So those records
are also read-only mappings (``MappingRecord``):
``rec.redone_steps`` and ``rec["redone_steps"]`` are the same value, ``dict(rec)`` is the old
dict. A report whose contents are open-ended (the engine's counters, which grow with its
features) keeps the fields the driver reads as fields and the rest as ``details``, read through
the same mapping.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from zeroray.config import ZeroConfig
from zeroray.engine.step_result import StepStats
from zeroray.layout.arena import FlatLayout


class MappingRecord(Mapping):
    """A frozen dataclass that is also a read-only mapping of its fields ([Note: records read as
    mappings]); a ``details`` field, where there is one, is read through it as well (its keys after
    the fields').
    Subclasses are declared ``eq=False``: they compare as mappings do (with the old dicts too)."""

    def _items(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "details"}
        return {**out, **getattr(self, "details", {})}

    def __getitem__(self, key: str) -> Any:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a trainer builds its engine from (the Trainer checked it).

    ``group_name``: the prefix of the collective group's store keys, one per worker group, so a
    group rebuilt after a failure never meets the keys of the one before it."""

    model_fn: Callable[[], Any]
    loss_fn: Callable
    optimizer: Any
    zero: ZeroConfig
    seed: int
    param_groups: Optional[Callable] = None
    scheduler: Optional[Callable] = None
    group_name: str = "zr"

    def in_group(self, group_name: str) -> "WorkerSpec":
        return replace(self, group_name=group_name)


@dataclass(frozen=True)
class SetupInfo:
    """A worker's answer to ``setup``: its engine's layout and what the driver needs of it.

    ``state_layout``, ``state_rank``: the layout its exported state is cut by and its rank in
    it (``Engine.state_layout()``; stage 0 keeps the whole state on every rank), which a resize
    cuts the old workers' state for ([Note: resize transfer] in worker/state_transfer.py)."""

    layout: FlatLayout
    state_layout: FlatLayout
    state_rank: int
    state_dict_keys: Tuple[str, ...]  # model.state_dict()'s keys, in its order
    build_s: float                    # seconds to build the engine
    peak_rss_bytes: int               # the worker's peak RSS once built
    rendezvous_s: float = 0.0         # seconds to join the collective group (before the build)
    # its optimizer steps whole parameters, whose state their owners hold (engine/shaped_optim.py)
    whole_params: bool = False

    def resize_target(self) -> Tuple[FlatLayout, int]:
        """What ``cut_pieces`` takes for this worker: (its state layout, its rank)."""
        return self.state_layout, self.state_rank


@dataclass(frozen=True)
class Hops:
    """When a step passed each hop on the worker, ``time.time()`` seconds: the call arrived
    (``actor_start``), its turn came (``engine_start``), the engine returned (``engine_end``)."""

    actor_start: float
    engine_start: float
    engine_end: float

    def as_dict(self) -> Dict[str, float]:
        return {"actor_start": self.actor_start, "engine_start": self.engine_start, "engine_end": self.engine_end}


@dataclass(frozen=True)
class StepRecord:
    """One worker's result of one step: the engine's ``StepStats`` as it returned them, and the
    hops (the driver combines the workers' records into a StepResult, execution/pipeline.py).

    ``stats.loss`` is this worker's share of the loss, weighted by its rows (their mean is the
    global loss); ``stats.grad_norm`` is global, the same on every worker."""

    stats: StepStats
    hops: Hops


@dataclass(frozen=True)
class SplitInfo:
    """A worker's answer to ``attach_data``: its Ray Data split's first local batch, read ahead
    (runtime/worker/local_feed.py). ``tokens``: the largest column's element count."""

    has_next: bool
    rows: int = 0
    tokens: int = 0


@dataclass(frozen=True, eq=False)
class NodeInfo(MappingRecord):
    """Where a worker runs (``Worker.node_info``, a poll); ``trainer.workers`` lists them.
    ``placement_group_id``: the hex id of the placement group its actor is in (None: none), which
    zeroray.tune checks is the trial's ([Note: given placement group] in worker_group/placement.py)."""

    rank: int
    node_id: str
    ip: str
    pid: int
    host: str
    gpu_ids: Tuple[Any, ...] = ()
    placement_group_id: Optional[str] = None


@dataclass(frozen=True, eq=False)
class WorkerProgress(MappingRecord):
    """How far a rank got in the current step (``Worker.progress``, a poll): its step count
    (None before its engine is built), the collectives it issued, whether an engine call runs.
    A mapping too, as the poll's answer was read before it was typed."""

    rank: int
    step: Optional[int]
    collectives: int
    busy: bool


@dataclass(frozen=True, eq=False)
class CommReport(MappingRecord):
    """A worker's communication counters of the last step (``Worker.comm_report``): ``details``
    holds the collective group's counters, stage 3's fetch counters and the buckets' stats, as
    their modules report them ([Note: records read as mappings])."""

    rank: int
    details: Mapping[str, Any]


@dataclass(frozen=True, eq=False)
class MemoryReport(MappingRecord):
    """A worker's memory (``Worker.memory_report``): its RSS now, what one in-memory snapshot of
    it takes in the object store, and ``details``, memory/report.py's ``measure``."""

    rank: int
    rss_bytes: int
    snapshot_bytes: int
    details: Mapping[str, Any]


@dataclass(frozen=True)
class SnapshotRecord:
    """A rank's small record of an in-memory snapshot, the one the driver waits on: the step it holds."""

    step: int


@dataclass(frozen=True)
class ExportDone:
    """The last return of ``Worker.export_pieces`` (a resize), the one the driver waits on."""

    step: int


@dataclass(frozen=True)
class OptimizerPart:
    """A rank's part of the optimizer record ([Note: optimizer record] in
    engine/optim_record.py): a JSON record, written into the checkpoint's manifest as it is."""

    record: Mapping[str, Any]


@dataclass(frozen=True)
class SavedShard:
    """A worker's answer to ``save_shard``: its shard's file entry, rank 0's extra file's entry
    (None elsewhere) and its part of the optimizer record."""

    shard: Any
    extra: Any
    optimizer: OptimizerPart


@dataclass(frozen=True, eq=False)
class OptimizerPlan(MappingRecord):
    """What a worker's load takes of the checkpoint's optimizer (controller/optimizer_restore.py's
    ``LoadPlan``, without its log lines): each group's hyperparameters, the scheduler's state,
    or no optimizer state at all. A mapping, as engine/optim_record.py's ``with_plan`` reads it."""

    groups: Mapping[str, Any]
    scheduler: Optional[Mapping[str, Any]]
    fresh_optimizer: bool


@dataclass(frozen=True, eq=False)
class RecoveryRecord(MappingRecord):
    """One recovery of a fit (``trainer.recoveries``): what failed, when it was seen and when
    the fit resumed, at which step and size, how (``mode``: replace, shrink or restart) and from
    what (``restored_from``: memory, disk or initial weights); ``details``: the seconds of each
    phase and what the mode reports (``details``: ``replaced``, ``spares_used``, ``snapshot_lost``, ...).
    Read as a mapping too ([Note: records read as mappings])."""

    cause: str
    detected_at: float
    resumed_at: float
    seconds: float
    step: int
    redone_steps: int
    num_workers: int
    attempts: int
    mode: str
    restored_from: str
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def node_list(nodes: List[NodeInfo]) -> List[NodeInfo]:
    """``nodes`` renumbered in list order (a re-formed or shrunk group's ranks)."""
    return [replace(node, rank=rank) for rank, node in enumerate(nodes)]
