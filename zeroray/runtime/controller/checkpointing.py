"""The Controller's checkpoints: save, load, verify, and the note a failed save leaves.

``Checkpoints`` is one of the Controller's collaborators (controller/controller.py): it owns the
last checkpoint (its path and step) and the restore choice, and is their only writer; it reads
the group and the position the Controller shares with it (whether the Trainer may save now is
the Controller's to say: ``Controller.save``, and fit's own saves). Every worker writes or
reads its own shard in parallel; the driver commits the manifest ([Note: checkpoint commit protocol]
in checkpoint/store.py) and plans what a load takes of the saved optimizer ([Note: restoring
the optimizer] in controller/optimizer_restore.py).

[Note: failed saves]
A save that cannot be written (a full disk, a storage that refuses a write, on a worker or on
the driver) stops the run with that error, its own type and message (``OSError: [Errno 28] No
space left on device``), plus a note saying what was kept. Nothing is lost: the commit
protocol ([Note: checkpoint commit protocol] in checkpoint/store.py) never wrote the manifest
or ``latest``, so the previous checkpoint stays the latest and loads; the workers still hold
the trained step, so once the storage is fixed ``trainer.save()`` or another ``fit`` goes on
from it. The writes are independent (no collective), so the group stays usable. Training on
with a logged error instead would leave a long run silently without a recent checkpoint: the
next worker failure would throw away every step since the last good save.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from zeroray.engine.optim_record import merge_parts
from zeroray.runtime.controller.optimizer_restore import LoadPlan, RestoreChoice, plan_load
from zeroray.runtime.execution.pipeline import GroupSlot, Position
from zeroray.runtime.failures import is_worker_failure
from zeroray.runtime.records import WorkerSpec

log = logging.getLogger("zeroray")


class Checkpoints:
    """save / load / verify of the trainer's checkpoints, and the last one saved or loaded."""

    def __init__(self, slot: GroupSlot, position: Position, spec: WorkerSpec) -> None:
        self.slot, self.position, self.spec = slot, position, spec
        self.last: Optional[str] = None      # the last checkpoint saved or loaded (its step directory)
        self.last_step: Optional[int] = None  # the step it holds
        # what the optimizer was built from and which of it was given: Trainer.restore's choice,
        # which every load of a checkpoint follows ([Note: restoring the optimizer] in controller/optimizer_restore.py)
        self.restore_choice = RestoreChoice(spec.optimizer, spec.param_groups, spec.scheduler)
        self._fresh_at: Optional[str] = None  # the checkpoint a fresh_optimizer restore started from

    def save(self, root: Any, keep: Optional[int]) -> Any:
        """Every worker writes its shard in parallel, then the driver commits the manifest.
        A write that fails leaves the last checkpoint as it was; see [Note: failed saves]."""
        from zeroray.checkpoint import ManifestFields, commit

        step = self.position.step_count
        group = self.slot.get()
        info = group.setup_info[0]
        try:
            # Independent writes: one worker's failed write does not leave the others out of step.
            outs = group.wait_all(group.call("save_shard", root, step), None, "save", independent=True)
            infos = [o.shard for o in outs] + [o.extra for o in outs if o.extra is not None]
            fields = ManifestFields(layout=info.layout, data_position=self.position.data_position,
                                    config={"zero": repr(self.spec.zero), "scaling": repr(group.scaling),
                                            "seed": self.spec.seed},
                                    extra={"state_dict_keys": list(info.state_dict_keys)},
                                    optimizer=merge_parts([o.optimizer.record for o in outs], self.spec.optimizer,
                                                          self.spec.param_groups))
            self.last = commit(root, step, fields, infos, keep=keep)
            self.last_step = step
        except Exception as error:
            if not is_worker_failure(error):
                error.add_note(self._failed_save_note(root))
            raise
        return self.last

    def _failed_save_note(self, root: Any) -> str:
        from zeroray.checkpoint import latest_checkpoint

        try:
            latest = latest_checkpoint(root)
        except Exception:  # noqa: BLE001 - the storage may be what failed
            latest = None
        kept = (f"{latest} is still the latest checkpoint and loads" if latest is not None
                else "there is no earlier checkpoint there")
        step = self.position.step_count
        return (f"zeroray: saving step {step} to {root} failed and nothing was committed: {kept}. "
                f"The trainer still holds step {step} (data_position {self.position.data_position}): fix the "
                "storage (free space, permissions) and call trainer.save(), or fit(...) again to go on")

    def load(self, path: Any) -> None:
        """Every worker reads its slices of the checkpoint at ``path`` (a root or a step directory)."""
        from zeroray.checkpoint import checkpoint_dir, load_manifest

        step_dir = checkpoint_dir(path)  # every worker reads the same step, even if a save lands now
        manifest = load_manifest(step_dir)
        group = self.slot.get()
        plan = self._optimizer_plan(manifest, step_dir)
        steps = group.wait_all(group.call("load_checkpoint", step_dir, plan.for_workers()), None, "restore")
        self.position.set(steps[0], int(manifest.data_position or 0))
        self.last, self.last_step = step_dir, steps[0]

    def _optimizer_plan(self, manifest: Any, step_dir: Any) -> LoadPlan:
        """What loading ``step_dir`` takes of its optimizer, given the workers' own build and
        what the trainer was given ([Note: restoring the optimizer] in controller/optimizer_restore.py); logged."""
        group = self.slot.get()
        parts = group.wait_all(group.call("optimizer_record"), None, "restore: the optimizer as built")
        live = merge_parts([p.record for p in parts], self.spec.optimizer, self.spec.param_groups)
        fresh = self.restore_choice.fresh_optimizer and self._fresh_at in (None, str(step_dir))
        plan = plan_load(manifest.optimizer, manifest.scalars, live, self.restore_choice, fresh)
        if fresh:
            self._fresh_at = str(step_dir)  # only this checkpoint: the ones saved since hold the new state
        for line in plan.lines:
            log.info("zeroray: %s", line)
        return plan

    def verify(self, step_dir: Any) -> None:
        """Every worker checks its share of the checkpoint's files (sizes, sha256) in parallel;
        raises the CheckpointError of the first damaged file. No collective: the group stays usable."""
        from zeroray.checkpoint import load_manifest

        files = [e.file for e in load_manifest(step_dir).files()]
        group = self.slot.get()
        n = group.num_workers
        group.wait_all(group.call("verify_files", per_rank=[(step_dir, files[r::n]) for r in range(n)]), None,
                       "verify the checkpoint", independent=True)
