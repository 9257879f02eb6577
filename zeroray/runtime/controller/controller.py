"""The driver's state machine: ``Controller`` owns the worker group and everything the trainer knows.

[Note: trainer states]
One ``Controller`` per ``zr.Trainer`` (Ray Train v2's controller is the model). Its state says
what the trainer is doing, and each transition is one of its methods:

    IDLE -> STEPPING -> IDLE                                step()
    IDLE -> FITTING (-> RECOVERING -> FITTING)* -> IDLE     fit(), its Recovery.recover()
    IDLE -> RESIZING -> IDLE                                resize()
    IDLE -> EVALUATING -> IDLE                              evaluate() (fit evaluates while FITTING)
    IDLE -> RUNNING -> IDLE                                 run()
    RECOVERING -> CLOSED                                    recover() that could not restart
    any  -> CLOSED                                          close() (again: stays CLOSED)

Every change of state goes through the one table of moves (``TRANSITIONS`` in trainer_state.py,
through ``self.states``), close and recovery included. A call that its state does not allow
(``step`` from inside a ``fit`` callback, anything after ``close``) is a ``RuntimeError`` that says
what the trainer is doing; the Controller (and its recovery and resize) is what consults the
state: the pipeline and the checkpoints are told, not asked. The failure and scaling policies
(controller/policy.py) return decisions to ``recover``, which acts on them. Every step goes
through its ``StepPipeline`` ([Note: one step pipeline] in execution/pipeline.py): ``step`` sends
one and collects it; ``fit`` brackets a fit in one place: FITTING, the fit's start on the pipeline
and on recovery, the pipeline's runs of its steps (``StepPipeline.run``, Ray Data input included)
with a recovery between two, and the end, IDLE again before the reporters hear of it.

The Controller owns its state: the position (the step count, and the data position: a step of
fit's consumed one global batch of fit's data; ``fit``, ``load``, recovery and ``seek`` set it,
the pipeline advances it), the group (and whether a failure keeps its survivors) and the
scaling. Its collaborators own theirs, each the only writer: ``StepPipeline`` the steps in flight
and a fit's snapshot, ``Checkpoints`` (controller/checkpointing.py) the last checkpoint and the
restore choice, ``Recovery`` (controller/recovery.py) a fit's failures and the record of its
recoveries, ``Resizing`` (controller/resize.py) nothing beyond one resize.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.config import ScalingConfig, ZeroConfig
from zeroray.runtime.code_shipping import ship_by_value
from zeroray.runtime.controller.checkpointing import Checkpoints
from zeroray.runtime.controller.recovery import Recovery
from zeroray.runtime.controller.resize import Resizing
from zeroray.runtime.execution.pipeline import FitPlan, GroupSlot, Position, SnapshotKeeper, StepPipeline
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
        self.pipeline = StepPipeline(self.slot, zero, self.position)  # the steps in flight
        self.checkpoints = Checkpoints(self.slot, self.position, spec)
        self.recovery = Recovery(spec, self.states, self.pipeline, self.checkpoints, self._start, self._adopt,
                                 self._drop_broken)
        self.resizing = Resizing(spec, spares, self.states, self.pipeline, self._adopt)
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
        self._keep_survivors(group)
        info = group.setup_info[0]
        self.layout: FlatLayout = info.layout
        self.state_dict_keys: List[str] = list(info.state_dict_keys)

    def _keep_survivors(self, group: WorkerGroup) -> None:
        """A failure keeps the survivors for a replacement while a fit keeps in-memory snapshots
        ([Note: replace, don't restart] in worker_group/reform.py); the pipeline holds a snapshot
        cadence only then."""
        group.keep_survivors = bool(self.pipeline.snapshots.every)

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

    def fit(self, plan: FitPlan) -> List[StepResult]:
        """IDLE -> FITTING (-> RECOVERING -> FITTING)* -> IDLE: Trainer.fit on ``plan`` (fit/loop.py
        built it: [Note: pipelined steps], [Note: data replay] there). The pipeline runs its steps;
        after a worker failure ``Recovery.recover`` rebuilds the group and the pipeline runs again
        from where recovery resumed. The reporters hear ``fit_start`` first and ``fit_end`` last, once the
        Trainer is idle again (``on_fit_end`` may evaluate), also when fit raises."""
        self.states.enter(TrainerState.FITTING)
        error: Optional[BaseException] = None
        try:
            with self.pipeline.fitting(plan):  # the fit's snapshot cadence and start; its snapshot released after
                self._keep_survivors(self.slot.group)
                origin = (self.position.step_count, self.position.data_position)
                self.recovery.begin(plan.failure, origin)
                plan.report("fit_start", origin[0])
                return self._run(plan)
        except BaseException as raised:
            error = raised
            raise
        finally:
            plan.report("fit_end", self._end_fit(), error)

    def _run(self, plan: FitPlan) -> List[StepResult]:
        """The pipeline's runs of one fit, a recovery between two (see ``fit``): its StepResults."""
        results: List[StepResult] = []
        resave = False
        while True:
            try:
                if resave:  # the save a failure interrupted: recovery resumed at its step
                    plan.report("checkpoint", self.position.step_count, plan.save())
                self.pipeline.run(plan, results)
                return results
            except Exception as failed:  # noqa: BLE001 - classified by recover: raise, or restart
                self.recovery.recover(failed, plan.note, self.scaling)  # FITTING -> RECOVERING -> FITTING, or raises
                step = self.position.step_count
                plan.report("recovery", self.recovery.recoveries[-1])
                results[:] = [r for r in results if r.step <= step]  # replayed by the next run
                # From an in-memory snapshot, recovery may resume exactly at a step whose save
                # the failure interrupted (a worker died writing it): the run would not save that
                # step again, and a later recovery would find only an older checkpoint.
                resave = step > 0 and plan.saves_at(step) and self.checkpoints.last_step != step

    def _end_fit(self) -> int:
        """FITTING -> IDLE (also after fit raised); returns the step count the fit ends at."""
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
        """Every worker writes its shard (while the Trainer is idle, or from a fit: its callbacks'
        saves); see ``Checkpoints.save`` and [Note: failed saves]."""
        if self.state not in (TrainerState.IDLE, TrainerState.FITTING):
            raise RuntimeError(f"cannot save while the Trainer is {self.state.value}")
        return self.checkpoints.save(root, keep)

    def load(self, path: Any) -> None:
        self.checkpoints.load(path)

    def verify(self, step_dir: Any) -> None:
        self.checkpoints.verify(step_dir)

    def resize(self, num_workers: int) -> None:
        """IDLE -> RESIZING -> IDLE: see ``Resizing.resize``."""
        self.scaling = self.resizing.resize(num_workers, self.scaling)
