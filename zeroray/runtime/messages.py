"""What crosses the actor boundary between the driver and a worker: typed, frozen messages.

Ray pickles each of these whole. The driver builds a ``WorkerSpec`` once per trainer and every
worker builds its engine from it (``Worker.setup``), answering with a ``SetupInfo``; every
step answers with a ``StepOutput`` (``Worker.train_step``, ``Worker.train_next``), and
attaching a Ray Data split with a ``SplitInfo``. Checkpoint manifests have their own typed
fields (``ManifestFields``, ``Manifest`` in checkpoint/manifest.py): those are a file format,
not a message.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple

from zeroray.config import ZeroConfig
from zeroray.layout.arena import FlatLayout


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
    cuts the old workers' state for ([Note: resize transfer] in state_transfer.py)."""

    layout: FlatLayout
    state_layout: FlatLayout
    state_rank: int
    state_dict_keys: Tuple[str, ...]  # model.state_dict()'s keys, in its order
    build_s: float                    # seconds to build the engine
    peak_rss_bytes: int               # the worker's peak RSS once built
    rendezvous_s: float = 0.0         # seconds to join the collective group (before the build)

    def resize_target(self) -> Tuple[Dict[str, Any], int]:
        """What ``cut_pieces`` takes for this worker: (its state layout's to_dict(), its rank)."""
        return self.state_layout.to_dict(), self.state_rank


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
class StepOutput:
    """One worker's result of one step (the driver combines them into a StepResult, step.py)."""

    loss: float                  # this worker's share of the loss, weighted by its rows: their mean is the global loss
    grad_norm: float             # global: the same on every worker
    step: int                    # optimizer steps taken so far, this one included
    skipped: bool                # fp16 overflow: the update was skipped
    loss_scale: Optional[float]
    time_s: float                # the engine's time for the step
    hops: Hops


@dataclass(frozen=True)
class SplitInfo:
    """A worker's answer to ``attach_data``: its Ray Data split's first local batch, read ahead
    (runtime/local_feed.py). ``tokens``: the largest column's element count."""

    has_next: bool
    rows: int = 0
    tokens: int = 0
