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
The failure and scaling policies (policy.py) return decisions to ``recover``, which acts on
them. Every step goes through its ``StepPipeline`` ([Note: one step pipeline] in pipeline.py):
``step`` sends one and collects it; ``fit`` (fit_loop.py) and Ray Data input (data.py) keep
steps in flight through ``controller.pipeline`` while the Trainer is FITTING.

The Controller owns its state: the position (the step count, and the data position: a step
collected while FITTING consumed one global batch of fit's data; ``begin_fit``, ``load``,
recovery and ``seek`` set it, the pipeline advances it), the last checkpoint, the group.

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
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

from zeroray.layout.arena import FlatLayout
from zeroray.config import ScalingConfig, ZeroConfig
from zeroray.engine.optim_record import merge_parts
from zeroray.runtime.code_shipping import ship_by_value
from zeroray.runtime.failures import PlacementError, WorkerSetupError, is_worker_failure
from zeroray.runtime.records import RecoveryRecord, WorkerSpec
from zeroray.runtime.optimizer_restore import LoadPlan, RestoreChoice, plan_load
from zeroray.runtime.policy import Action, FailurePolicy, ScalingPolicy
from zeroray.runtime.pipeline import GroupSlot, Position, StepPipeline
from zeroray.runtime.snapshot import Snapshot, SnapshotKeeper
from zeroray.runtime.step import StepResult
from zeroray.runtime.trainer_state import StateMachine, TrainerState
from zeroray.runtime.worker_group import WorkerGroup

log = logging.getLogger("zeroray")


class Controller:
    """Owns the worker group, the step count, the data position and the last checkpoint; every
    change of what the trainer is doing goes through one of its methods ([Note: trainer states])."""

    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, zero: ZeroConfig, spares: int = 0) -> None:
        self.spec, self.scaling, self.zero = spec, scaling, zero
        self.spares = spares  # warm spare actors per group ([Note: replace, don't restart] in worker_group.py)
        self.slot = GroupSlot()
        self.states = StateMachine()              # what the trainer is doing: its only writer
        self.position = Position()                 # the step count and fit's data position
        self.pipeline = StepPipeline(self.slot, zero, self.states, self.position)  # the steps in flight
        self.last_checkpoint: Optional[str] = None
        self.last_checkpoint_step: Optional[int] = None  # the step last_checkpoint holds
        self.last_recovery_s: Optional[float] = None  # fit: seconds from a worker failure to resuming
        self.recoveries: List[RecoveryRecord] = []    # fit: one record per restart (cause, timing, size)
        self._fit_origin = (0, 0)                  # (step_count, data_position) where this fit began
        # what the optimizer was built from and which of it was given: Trainer.restore's choice,
        # which every load of a checkpoint follows ([Note: restoring the optimizer] in optimizer_restore.py)
        self.restore_choice = RestoreChoice(spec.optimizer, spec.param_groups, spec.scheduler)
        self._fresh_at: Optional[str] = None       # the checkpoint a fresh_optimizer restore started from
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

    def _start(self, num_workers: int) -> None:
        self._adopt(WorkerGroup(self.spec, num_workers, self.scaling, spares=self.spares))

    def _adopt(self, group: WorkerGroup) -> None:
        self.slot.group = group
        group.keep_survivors = self._replaceable()
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

    def evaluate_in_fit(self, data: Any, metric_fn: Optional[Callable],
                        dataset_batch_size: Optional[int]) -> Dict[str, float]:
        """fit's evaluation, between complete steps: FITTING, with no step in flight."""
        if self.state is not TrainerState.FITTING:
            raise RuntimeError(f"fit evaluates while the Trainer is fitting, not {self.state.value}: a zeroray bug")
        return self.pipeline.evaluate(data, metric_fn, dataset_batch_size)

    def run(self, fn: Callable, args: Tuple[Any, ...]) -> Any:
        """IDLE -> RUNNING -> IDLE: see Trainer.run."""
        self.states.enter(TrainerState.RUNNING)
        try:
            group = self.group
            return group.wait_all(group.call("run", fn, ray.put(args)), None, "run")[0]
        finally:
            self.states.leave(TrainerState.RUNNING)

    # --- fit -------------------------------------------------------------------------------

    def begin_fit(self, skip: Optional[int], snapshot_every: Optional[int] = None) -> None:
        """IDLE -> FITTING: the fit's data starts at ``skip`` (default: the current data position);
        every ``snapshot_every`` steps an in-memory snapshot ([Note: in-memory snapshots])."""
        self.states.enter(TrainerState.FITTING)
        self.pipeline.snapshots = SnapshotKeeper(snapshot_every)
        self.group.keep_survivors = self._replaceable()
        self.position.set(data_position=skip)
        self._fit_origin = (self.step_count, self.data_position)

    def end_fit(self) -> None:
        """FITTING -> IDLE (also after fit raised). The snapshot is released: it serves this fit only."""
        self.snapshots.drop()
        self._drop_broken()
        if self.slot.group is not None:
            self.slot.group.keep_survivors = False
        self.states.leave(TrainerState.FITTING)

    def _replaceable(self) -> bool:
        """A failure keeps the survivors for a replacement: a fit with in-memory snapshots runs."""
        return self.state in (TrainerState.FITTING, TrainerState.RECOVERING) and bool(self.snapshots.every)

    def _drop_broken(self) -> None:
        """Kill the survivors a failed group kept, when no replacement follows."""
        group = self.slot.group
        if group is not None and group.failed is not None and group.actors:
            group.shutdown()

    def recover(self, error: BaseException, failures: FailurePolicy, scaling: ScalingPolicy,
                note: Callable[[str], None]) -> None:
        """FITTING -> RECOVERING -> FITTING: ask the FailurePolicy; raise, or rebuild the group
        (of the size the ScalingPolicy decides) and load the last checkpoint.

        The group already tore itself down when it raised (see [Note: failure detection] in
        worker_group.py). A failure while restarting (another worker dies) counts as one more.
        """
        detected = time.monotonic()
        applied = self.step_count  # steps applied when the failure was seen: those past the checkpoint are redone
        self.states.enter(TrainerState.RECOVERING)
        attempts = 0  # replacements or restarts tried; a death during one counts as one more failure
        try:
            while True:
                attempts += 1
                decision = failures.on_failure(error, user_error=not is_worker_failure(error))
                if decision.action is Action.RAISE:
                    if failures.exhausted:
                        raise RuntimeError(f"training failed: {decision.reason}; original cause: "
                                           f"{type(error).__name__}: {error}") from error
                    raise error  # user code or input: the worker's own error, as it is
                group = self.slot.group
                replace = group is not None and bool(group.survivors)
                note(f"zeroray: {decision.reason}; {'replacing the lost worker(s)' if replace else 'restarting'} "
                     f"from {self._restart_source()}")
                try:
                    timings = self._replace(scaling, decision.reason, note) if replace else \
                        self._restart(scaling, decision.reason, note)
                    break
                except Exception as again:  # noqa: BLE001
                    if not is_worker_failure(again):
                        raise
                    error = again
        except BaseException:  # back to the fit, which raises; without a group, nothing can go on
            self._drop_broken()
            self.states.enter(TrainerState.FITTING if self.slot.group is not None else TrainerState.CLOSED)
            raise
        self.states.leave(TrainerState.RECOVERING, TrainerState.FITTING)
        resumed = time.monotonic()
        self.last_recovery_s = resumed - detected
        mode, restored_from = timings.pop("mode"), timings.pop("restored_from")
        self.recoveries.append(RecoveryRecord(
            cause=f"{type(error).__name__}: {error}", detected_at=detected, resumed_at=resumed,
            seconds=resumed - detected, step=self.step_count, redone_steps=max(0, applied - self.step_count),
            num_workers=self.num_workers, attempts=attempts, mode=mode, restored_from=restored_from,
            details=timings))
        note(f"zeroray: resumed at step {self.step_count} with {self.num_workers} worker(s), "
             f"{self.last_recovery_s:.1f} s after the failure was detected")

    def _replace(self, scaling: ScalingPolicy, reason: str, note: Callable[[str], None]) -> Dict[str, Any]:
        """Keep the survivors, put new workers (spares first) in the lost ranks, re-form the group
        and load the snapshot into every worker ([Note: replace, don't restart] in worker_group.py).
        When the new workers cannot be placed, go on with the survivors alone where the scaling
        policy allows ([Note: shrink in memory]); otherwise, or when they cannot be built, restart
        the whole group."""
        t0 = time.monotonic()
        self.pipeline.forget()
        timeout_s = self.scaling.placement_timeout_s
        try:
            timings: Dict[str, Any] = {"mode": "replace", **self.group.replace(self.spec, timeout_s)}
        except (PlacementError, WorkerSetupError) as error:
            first = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            decision = scaling.on_lost(len(self.group.survivors)) if isinstance(error, PlacementError) else None
            if decision is None or decision.action is not Action.RESIZE:
                note(f"zeroray: replacing the lost worker(s) failed ({first}); restarting the whole group")
                return {**self._restart(scaling, reason, note), "replace_failed": str(error).splitlines()[0]}
            note(f"zeroray: replacing the lost worker(s) failed ({first}); {decision.reason}")
            timings = {"mode": "shrink", "replace_failed": str(error).splitlines()[0],
                       **self.group.shrink(self.spec, timeout_s)}
        self._adopt(self.group)
        return self._restore_after_failure(reason, note, timings, time.monotonic(), t0)

    def _restart(self, scaling: ScalingPolicy, reason: str, note: Callable[[str], None]) -> Dict[str, float]:
        """Tear the group down, start one of the size the cluster offers, load the last checkpoint.
        Returns the seconds spent in each phase."""
        t0 = time.monotonic()
        self.slot.release()
        self.pipeline.forget()
        decision = scaling.on_restart(*_free_resources(scaling))
        if decision.action is Action.RESIZE:
            note(f"zeroray: {decision.reason}")
        t1 = time.monotonic()
        self._start(decision.num_workers)
        t2 = time.monotonic()
        timings = {"mode": "restart", "teardown_s": t1 - t0, "start_s": t2 - t1, **self.group.timings}
        return self._restore_after_failure(reason, note, timings, t2, t0)

    def _restore_after_failure(self, reason: str, note: Callable[[str], None], timings: Dict[str, Any],
                               t2: float, t0: float) -> Dict[str, Any]:
        """Load the newest complete snapshot into the (re-formed or new) group, or else the last
        disk checkpoint, or else start over from the initial weights."""
        timings.setdefault("start_s", t2 - t0)
        origin_step, origin_position = self._fit_origin
        timings["restored_from"] = "memory"
        if self._newer_snapshot() is not None:
            lost = self._load_snapshot(self._newer_snapshot())
            if lost is None:
                timings["restore_s"] = time.monotonic() - t2
                return timings
            note(f"zeroray: the in-memory snapshot of step {self.snapshots.complete.step} is lost ({lost}); "
                 f"restarting from {self.last_checkpoint or 'the initial weights (no checkpoint yet)'} instead")
            timings["snapshot_lost"] = lost
            self.snapshots.drop()
        timings["restored_from"] = "disk" if self.last_checkpoint is not None else "initial weights"
        if self.last_checkpoint is not None:
            self.load(self.last_checkpoint)
            if self.step_count < origin_step:
                raise RuntimeError(f"a worker failed ({reason}) and the last checkpoint ({self.last_checkpoint}, "
                                   f"step {self.step_count}) is older than this fit, which began at step "
                                   f"{origin_step}: the steps in between cannot be replayed. Save before fit, or set "
                                   "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
            # One global batch per step since fit began; a checkpoint from before this fit recorded
            # its position in other data, so the position is counted from the fit's origin.
            self.position.set(data_position=origin_position + self.step_count - origin_step)
        else:
            if origin_step != 0:
                raise RuntimeError(f"a worker failed ({reason}) and there is no checkpoint to resume from: the run "
                                   f"had already trained {origin_step} steps before fit began. Set "
                                   "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
            # No checkpoint yet: the fresh workers hold the initial weights (same seed); start over.
            self.position.set(0, origin_position)
        timings["restore_s"] = time.monotonic() - t2
        return timings

    def _newer_snapshot(self) -> Optional[Snapshot]:
        """The complete in-memory snapshot, unless the last disk checkpoint is newer (at the same
        step, memory is the faster read)."""
        snap = self.snapshots.complete
        if snap is None or (self.last_checkpoint_step is not None and self.last_checkpoint_step > snap.step):
            return None
        return snap

    def _restart_source(self) -> str:
        snap = self._newer_snapshot()
        if snap is not None:
            return f"the in-memory snapshot of step {snap.step}"
        return self.last_checkpoint or "the initial weights (no checkpoint yet)"

    def _load_snapshot(self, snap: Snapshot) -> Optional[str]:
        """Every new worker fetches its share of ``snap``, then (only if all could) imports it.
        None when loaded; what was lost otherwise, with the group still usable (no collective ran)."""
        from zeroray.runtime.snapshot import needed_ranks

        group, old_layout = self.group, snap.layout
        args = []
        for info in group.setup_info:
            needed = set(needed_ranks(old_layout, info.resize_target()))
            args.append((snap.layout, [ref if r in needed else None for r, ref in enumerate(snap.shards)],
                         [snap.untrained]))  # refs inside lists: each worker fetches them one at a time
        problems = group.wait_all(group.call_each("stage_snapshot", args), None, "restore the in-memory snapshot",
                                  independent=True)
        lost = [f"worker {r}: {p}" for r, p in enumerate(problems) if p is not None]
        if lost:
            return "; ".join(lost)
        steps = group.wait_all(group.call("apply_snapshot"), None, "restore the in-memory snapshot")
        if steps[0] != snap.step:
            raise RuntimeError(f"the in-memory snapshot of step {snap.step} loaded as step {steps[0]}: a zeroray bug")
        self.position.set(snap.step, snap.data_position)
        return None

    # --- checkpoints -----------------------------------------------------------------------

    def save(self, root: Any, keep: Optional[int]) -> Any:
        """Every worker writes its shard in parallel, then the driver commits the manifest.
        A write that fails leaves the last checkpoint as it was; see [Note: failed saves]."""
        from zeroray.checkpoint import ManifestFields, commit

        if self.state not in (TrainerState.IDLE, TrainerState.FITTING):
            raise RuntimeError(f"cannot save while the Trainer is {self.state.value}")
        group = self.group
        try:
            # Independent writes: one worker's failed write does not leave the others out of step.
            outs = group.wait_all(group.call("save_shard", root, self.step_count), None, "save", independent=True)
            infos = [o.shard for o in outs] + [o.extra for o in outs if o.extra is not None]
            fields = ManifestFields(layout=self.layout, data_position=self.data_position,
                                    config={"zero": repr(self.zero), "scaling": repr(self.scaling),
                                            "seed": self.spec.seed},
                                    extra={"state_dict_keys": self.state_dict_keys},
                                    optimizer=merge_parts([o.optimizer.record for o in outs], self.spec.optimizer,
                                                          self.spec.param_groups))
            self.last_checkpoint = commit(root, self.step_count, fields, infos, keep=keep)
            self.last_checkpoint_step = self.step_count
        except Exception as error:
            if not is_worker_failure(error):
                error.add_note(self._failed_save_note(root))
            raise
        return self.last_checkpoint

    def _failed_save_note(self, root: Any) -> str:
        from zeroray.checkpoint import latest_checkpoint

        try:
            latest = latest_checkpoint(root)
        except Exception:  # noqa: BLE001 - the storage may be what failed
            latest = None
        kept = (f"{latest} is still the latest checkpoint and loads" if latest is not None
                else "there is no earlier checkpoint there")
        return (f"zeroray: saving step {self.step_count} to {root} failed and nothing was committed: {kept}. "
                f"The trainer still holds step {self.step_count} (data_position {self.data_position}): fix the "
                "storage (free space, permissions) and call trainer.save(), or fit(...) again to go on")

    def load(self, path: Any) -> None:
        """Every worker reads its slices of the checkpoint at ``path`` (a root or a step directory)."""
        from zeroray.checkpoint import checkpoint_dir, load_manifest

        step_dir = checkpoint_dir(path)  # every worker reads the same step, even if a save lands now
        manifest = load_manifest(step_dir)
        group = self.group
        plan = self._optimizer_plan(manifest, step_dir)
        steps = group.wait_all(group.call("load_checkpoint", step_dir, plan.for_workers()), None, "restore")
        self.position.set(steps[0], int(manifest.data_position or 0))
        self.last_checkpoint, self.last_checkpoint_step = step_dir, steps[0]

    def _optimizer_plan(self, manifest: Any, step_dir: Any) -> LoadPlan:
        """What loading ``step_dir`` takes of its optimizer, given the workers' own build and
        what the trainer was given ([Note: restoring the optimizer] in optimizer_restore.py); logged."""
        group = self.group
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
        group, n = self.group, self.num_workers
        group.wait_all(group.call_each("verify_files", [(step_dir, files[r::n]) for r in range(n)]), None,
                       "verify the checkpoint", independent=True)

    # --- resize ----------------------------------------------------------------------------

    def resize(self, num_workers: int) -> None:
        """IDLE -> RESIZING -> IDLE: the same training state on ``num_workers`` new workers.

        The new workers are placed and built while the old ones still hold the state; only once
        every new worker has loaded its shard are the old ones released ([Note: resize transfer]
        in state_transfer.py). If the new workers cannot be placed or built, the trainer goes on
        with its old workers and the error says so."""
        ScalingConfig(num_workers=num_workers)  # validates
        self.states.enter(TrainerState.RESIZING)
        try:
            old = self.group
            scaling = ScalingConfig(**{**vars(self.scaling), "num_workers": num_workers,
                                       "min_workers": min(self.scaling.min_workers or num_workers, num_workers)})
            old.release_spares()  # what they hold is the new group's room ([Note: spare placement] in worker_group.py)
            try:
                new = WorkerGroup(self.spec, num_workers, scaling, spares=self.spares, start_spares=False)
            except (PlacementError, WorkerSetupError) as error:
                old.start_spares()
                raise type(error)(
                    f"resize({num_workers}) did not happen, and the Trainer goes on with its {old.num_workers} "
                    f"worker(s), unchanged: {error}\nA resize starts the new workers before it releases the old "
                    "ones, so the cluster must hold both at once; to move into the same resources instead, save() "
                    "and zr.Trainer.restore(path, ..., scaling=zr.ScalingConfig(num_workers=...))") from error
            try:
                steps = self._move_state(old, new)
            except BaseException:
                new.shutdown()
                old.start_spares()
                raise
            old.shutdown()
            new.start_spares()  # once the old group is gone: its resources are theirs
            self._adopt(new)
            self.scaling = scaling
            self.position.set(step_count=steps[0])
        finally:
            self.states.leave(TrainerState.RESIZING)

    def _move_state(self, old: WorkerGroup, new: WorkerGroup) -> List[int]:
        """Every old worker's pieces straight to the new workers that own them; see [Note: resize transfer]."""
        targets = [info.resize_target() for info in new.setup_info]
        m = new.num_workers
        per_old = old.call("export_pieces", targets, num_returns=m + 1)  # per old rank: m pieces, then a record
        untrained = old.call("untrained_state", ranks=[0])[0]  # the replicated buffers and frozen parameters
        old.wait_all([refs[m] for refs in per_old], None, "resize: export the old shards")
        return new.wait_all(new.call_each("load_pieces", [([refs[j] for refs in per_old], untrained)
                                                          for j in range(m)]),
                            None, "resize: load the new shards")


def _free_resources(scaling: ScalingPolicy, wait_s: float = 3.0) -> Tuple[float, float]:
    """Free CPUs and GPUs, after giving Ray a moment to return the torn-down group's bundles."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources()
        cpus, gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
        if scaling.fits(cpus, gpus) >= scaling.target or time.monotonic() >= deadline:
            return cpus, gpus
        time.sleep(0.1)
