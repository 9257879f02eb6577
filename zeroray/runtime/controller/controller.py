"""The driver's state machine: ``Controller`` owns the worker group and everything the trainer knows.

[Note: trainer states]
One ``Controller`` per ``zr.Trainer`` (Ray Train v2's controller is the model). Its state says
what the trainer is doing, and each transition is one of its methods:

    IDLE -> STEPPING -> IDLE                                step()
    IDLE -> FITTING (-> RECOVERING -> FITTING)* -> IDLE     begin_fit(), recover(), end_fit()
    IDLE -> RESIZING -> IDLE                                resize()
    IDLE -> EVALUATING -> IDLE                              evaluate() (fit evaluates while FITTING)
    IDLE -> RUNNING -> IDLE                                 run()
    RECOVERING -> CLOSED                                    recover() that could not restart
    any  -> CLOSED                                          close() (again: stays CLOSED)

Every change of state goes through the one table of moves (``TRANSITIONS`` in trainer_state.py,
through ``self.states``), close and recovery included. A call that its state does not allow (``step`` from inside a ``fit``
callback, anything after ``close``) is a ``RuntimeError`` that says what the trainer is doing.
The failure and scaling policies (controller/policy.py) return decisions to ``recover``, which acts on
them. Every step goes through its ``StepPipeline`` ([Note: one step pipeline] in execution/pipeline.py):
``step`` sends one and collects it; ``fit`` (fit/loop.py) runs its steps, Ray Data input
(fit/data.py) included, through ``controller.pipeline.run`` while the Trainer is FITTING.

The Controller owns its state: the position (the step count, and the data position: a step
collected while FITTING consumed one global batch of fit's data; ``begin_fit``, ``load``,
recovery and ``seek`` set it, the pipeline advances it), the group and the scaling. Its
collaborators own theirs, each the only writer: ``Checkpoints`` (controller/checkpointing.py) the
last checkpoint and the restore choice, ``Recovery`` (controller/recovery.py) a fit's failures and
the record of its recoveries, ``Resizing`` (controller/resize.py) nothing beyond one resize.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.config import FailureConfig, ScalingConfig, ZeroConfig
from zeroray.runtime.code_shipping import ship_by_value
from zeroray.runtime.controller.checkpointing import Checkpoints
from zeroray.runtime.controller.recovery import Recovery
from zeroray.runtime.controller.resize import Resizing
from zeroray.runtime.execution.pipeline import GroupSlot, Position, SnapshotKeeper, StepPipeline
from zeroray.runtime.execution.step import StepResult
from zeroray.runtime.records import WorkerSpec
from zeroray.runtime.trainer_state import StateMachine, TrainerState
from zeroray.runtime.worker_group.group import WorkerGroup

log = logging.getLogger("zeroray")


class Controller:
    """Owns the worker group, the step count, the data position and the last checkpoint; every
    change of what the trainer is doing goes through one of its methods ([Note: trainer states])."""

    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, zero: ZeroConfig, spares: int = 0) -> None:
        self.spec, self.scaling, self.zero = spec, scaling, zero
        self.spares = spares  # warm spare actors per group ([Note: replace, don't restart] in worker_group/reform.py)
        self.slot = GroupSlot()
        self.states = StateMachine()              # what the trainer is doing: its only writer
        self.position = Position()                 # the step count and fit's data position
        self.pipeline = StepPipeline(self.slot, zero, self.states, self.position)  # the steps in flight
        self.checkpoints = Checkpoints(self.slot, self.position, self.states, spec)
        self.recovery = Recovery(spec, self.pipeline, self.checkpoints, self._start, self._adopt, self._drop_broken)
        self.resizing = Resizing(spec, spares, self.pipeline, self._adopt)
        ship_by_value(spec)  # before the first actor: [Note: shipping model code]
        self._start(scaling.num_workers)

    # --- the group -------------------------------------------------------------------------

    @property
    def state(self) -> TrainerState:
        return self.states.state

    @property
    def group(self) -> WorkerGroup:
        return self.slot.get()

    @property
    def step_count(self) -> int:
        return self.position.step_count

    @property
    def data_position(self) -> int:
        return self.position.data_position

    @property
    def snapshots(self) -> SnapshotKeeper:
        return self.pipeline.snapshots

    @property
    def num_workers(self) -> int:
        return self.group.num_workers

    @property
    def last_checkpoint(self) -> Optional[str]:
        return self.checkpoints.last

    @property
    def last_checkpoint_step(self) -> Optional[int]:
        return self.checkpoints.last_step

    def _start(self, num_workers: int) -> None:
        self._adopt(WorkerGroup(self.spec, num_workers, self.scaling, spares=self.spares))

    def _adopt(self, group: WorkerGroup) -> None:
        self.slot.group = group
        group.keep_survivors = self.recovery.replaceable()
        info = group.setup_info[0]
        self.layout: FlatLayout = info.layout
        self.state_dict_keys: List[str] = list(info.state_dict_keys)

    def close(self) -> None:
        """Release the actors and the placement group (any state -> CLOSED). Safe to call twice."""
        self.states.enter(TrainerState.CLOSED)
        self.pipeline.forget()
        self.slot.release()

    def seek(self, position: int) -> None:
        """IDLE: the next fit starts at global batch ``position`` of its data (``trainer.data_position = p``)."""
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"data_position={position!r} must be an integer >= 0 (global batches of fit's data)")
        if self.state is not TrainerState.IDLE:
            raise RuntimeError(f"data_position can be set only while the Trainer is idle, not {self.state.value}")
        self.position.set(data_position=position)

    # --- steps -----------------------------------------------------------------------------

    def step(self, batch: Any) -> StepResult:
        """One step on a global batch, collected before returning (IDLE -> STEPPING -> IDLE)."""
        self.states.enter(TrainerState.STEPPING)
        try:
            self.pipeline.send(batch)
            return self.pipeline.collect()
        finally:
            self.states.leave(TrainerState.STEPPING)

    # --- evaluation and inference ([Note: inference calls] in engine/inference.py) ---------------------

    def evaluate(self, data: Any, metric_fn: Optional[Callable],
                 dataset_batch_size: Optional[int]) -> Dict[str, float]:
        """IDLE -> EVALUATING -> IDLE: see Trainer.evaluate."""
        self.states.enter(TrainerState.EVALUATING)
        try:
            return self.pipeline.evaluate(data, metric_fn, dataset_batch_size)
        finally:
            self.states.leave(TrainerState.EVALUATING)

    def run(self, fn: Callable, args: Tuple[Any, ...]) -> Any:
        """IDLE -> RUNNING -> IDLE: see Trainer.run."""
        self.states.enter(TrainerState.RUNNING)
        try:
            group = self.group
            return group.wait_all(group.call("run", fn, ray.put(args)), None, "run")[0]
        finally:
            self.states.leave(TrainerState.RUNNING)

    # --- inspection: gathered to the driver -----------------------------------------------------

    def on_workers(self, method: str, *args: Any, ranks: Optional[List[int]] = None) -> List[Any]:
        """Engine call ``method`` on every worker (or ``ranks``), waited for: their answers, rank order."""
        group = self.group
        return group.wait_all(group.call(method, *args, ranks=ranks), None, method, ranks=ranks)

    def gather(self, names: List[str]) -> Dict[str, torch.Tensor]:
        """The named parameters, whole (fp32), from the shards that hold them."""
        pieces = self.on_workers("master_pieces", names)
        out = {}
        for name in names:
            slot = self.layout.slots[name]
            flat = torch.zeros(slot.numel, dtype=torch.float32)
            for rank_pieces in pieces:
                lo, hi, t = rank_pieces[name]
                if hi > lo:
                    flat[lo:hi] = t
            out[name] = flat.view(slot.shape)
        return out

    def untrained_state(self) -> Dict[str, torch.Tensor]:
        """Rank 0's buffers and frozen parameters (the same on every worker)."""
        return self.on_workers("untrained_state", ranks=[0])[0]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Trainer.state_dict: the fp32 parameters, whole, and the buffers, in ``state_dict_keys``' order."""
        params = self.gather(self.layout.param_names)
        untrained = self.untrained_state()
        out = {}
        for key in self.state_dict_keys:
            if key in self.layout.slots:
                out[key] = params[self.layout.slots[key].name].clone()
            elif key in untrained:
                out[key] = untrained[key]
        return out

    def parameter(self, name: str) -> torch.Tensor:
        """Trainer.get_parameter: one parameter (fp32, whole) or buffer, by its state_dict name."""
        if name in self.layout.slots:
            return self.gather([self.layout.slots[name].name])[self.layout.slots[name].name]
        untrained = self.untrained_state()
        if name in untrained:
            return untrained[name]
        raise KeyError(f"no parameter or buffer named {name!r}; names are those of model.state_dict(), "
                       f"e.g. {self.state_dict_keys[:5]}")

    # --- fit -------------------------------------------------------------------------------

    def begin_fit(self, skip: Optional[int], failure: FailureConfig) -> Tuple[int, int]:
        """IDLE -> FITTING: the fit's data starts at ``skip`` (default: the current data position);
        every ``failure.snapshot_every`` steps an in-memory snapshot ([Note: in-memory snapshots]);
        ``failure`` is what ``recover`` acts on. Returns where the fit begins: (step count, data position)."""
        self.states.enter(TrainerState.FITTING)
        self.pipeline.begin(failure.snapshot_every, skip)
        origin = (self.position.step_count, self.position.data_position)
        self.recovery.begin(failure, origin)
        return origin

    def recover(self, error: BaseException, note: Callable[[str], None]) -> None:
        """FITTING -> RECOVERING -> FITTING, or the error raised: see ``Recovery.recover``."""
        self.recovery.recover(error, note, self.scaling)

    def end_fit(self) -> int:
        """FITTING -> IDLE (also after fit raised); returns the step count the fit ends at. The
        snapshot is released: it serves this fit only."""
        self.pipeline.snapshots = SnapshotKeeper(None)
        self._drop_broken()
        if self.slot.group is not None:
            self.slot.group.keep_survivors = False
        self.states.leave(TrainerState.FITTING)
        return self.position.step_count

    def _drop_broken(self) -> None:
        """Kill the survivors a failed group kept, when no replacement follows."""
        group = self.slot.group
        if group is not None and group.failed is not None and group.actors:
            group.shutdown()

    # --- checkpoints and resize: the collaborators' (controller/checkpointing.py, controller/resize.py) ---

    def save(self, root: Any, keep: Optional[int]) -> Any:
        """Every worker writes its shard; see ``Checkpoints.save`` and [Note: failed saves]."""
        return self.checkpoints.save(root, keep)

    def load(self, path: Any) -> None:
        self.checkpoints.load(path)

    def verify(self, step_dir: Any) -> None:
        self.checkpoints.verify(step_dir)

    def resize(self, num_workers: int) -> None:
        """IDLE -> RESIZING -> IDLE: see ``Resizing.resize``."""
        self.scaling = self.resizing.resize(num_workers, self.scaling)
