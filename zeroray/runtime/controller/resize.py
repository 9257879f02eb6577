"""The Controller's resize: IDLE -> RESIZING -> IDLE, the same training state on another number of
workers, moved from the old workers' memory to the new ones' ([Note: resize transfer] in
worker/state_transfer.py).

``Resizing`` is one of the Controller's collaborators (controller/controller.py): it builds the
new group and moves the state; the Controller adopts the group and keeps the new scaling.
"""
from __future__ import annotations

from typing import Callable, List

from zeroray.config import ScalingConfig
from zeroray.runtime.execution.pipeline import StepPipeline
from zeroray.runtime.failures import PlacementError, WorkerSetupError
from zeroray.runtime.records import WorkerSpec
from zeroray.runtime.trainer_state import StateMachine, TrainerState
from zeroray.runtime.worker_group.group import WorkerGroup


class Resizing:
    """``Controller.resize``'s work: the new group, the state moved into it."""

    def __init__(self, spec: WorkerSpec, spares: int, states: StateMachine, pipeline: StepPipeline,
                 adopt: Callable[[WorkerGroup], None]) -> None:
        self.spec, self.spares, self.states, self._adopt = spec, spares, states, adopt
        self.slot, self.position = pipeline.slot, pipeline.position

    def resize(self, num_workers: int, current: ScalingConfig) -> ScalingConfig:
        """IDLE -> RESIZING -> IDLE: the same training state on ``num_workers`` new workers.

        The new workers are placed and built while the old ones still hold the state; only once
        every new worker has loaded its shard are the old ones released ([Note: resize transfer]
        in worker/state_transfer.py). If the new workers cannot be placed or built, the trainer goes on
        with its old workers and the error says so. ``current``: the Controller's scaling; returns the new one."""
        ScalingConfig(num_workers=num_workers)  # validates
        if current.placement_group is not None:  # [Note: given placement group] in worker_group/placement.py
            raise ValueError(f"resize({num_workers}): the workers are in bundles of a given placement group "
                             "(ScalingConfig(placement_group=...), e.g. a Ray Tune trial's), which has no room for a "
                             "second group beside them; save() and Trainer.restore(...) into a placement group of "
                             f"{num_workers} worker bundles instead (in Tune: the trial's resources)")
        self.states.enter(TrainerState.RESIZING)
        try:
            old = self.slot.get()
            scaling = ScalingConfig(**{**vars(current), "num_workers": num_workers,
                                       "min_workers": min(current.min_workers or num_workers, num_workers)})
            # what the spares hold is the new group's room ([Note: spare placement] in worker_group/placement.py)
            old.placement.release_spares()
            try:
                new = WorkerGroup(self.spec, num_workers, scaling, spares=self.spares, start_spares=False)
            except (PlacementError, WorkerSetupError) as error:
                old.placement.start_spares()
                raise type(error)(
                    f"resize({num_workers}) did not happen, and the Trainer goes on with its {old.num_workers} "
                    f"worker(s), unchanged: {error}\nA resize starts the new workers before it releases the old "
                    "ones, so the cluster must hold both at once; to move into the same resources instead, save() "
                    "and zr.Trainer.restore(path, ..., scaling=zr.ScalingConfig(num_workers=...))") from error
            try:
                steps = self._move_state(old, new)
            except BaseException:
                new.shutdown()
                old.placement.start_spares()
                raise
            old.shutdown()
            new.placement.start_spares()  # once the old group is gone: its resources are theirs
            self._adopt(new)
            self.position.set(step_count=steps[0])
        finally:
            self.states.leave(TrainerState.RESIZING)
        return scaling

    def _move_state(self, old: WorkerGroup, new: WorkerGroup) -> List[int]:
        """Every old worker's pieces straight to the new workers that own them; see [Note: resize transfer]."""
        targets = [info.resize_target() for info in new.setup_info]
        m = new.num_workers
        per_old = old.call("export_pieces", targets, num_returns=m + 1)  # per old rank: m pieces, then a record
        untrained = old.call("untrained_state", ranks=[0])[0]  # the replicated buffers and frozen parameters
        old.wait_all([refs[m] for refs in per_old], None, "resize: export the old shards")
        return new.wait_all(new.call("load_pieces", per_rank=[([refs[j] for refs in per_old], untrained)
                                                          for j in range(m)]),
                            None, "resize: load the new shards")
