"""The Controller's recovery from a worker failure during fit: FITTING -> RECOVERING -> FITTING.

``Recovery`` is one of the Controller's collaborators (controller/controller.py): it owns what a
fit knows of its failures (the fit's failure config and origin, its policies, one record per
recovery in ``recoveries``) and is their only writer. The failure policy decides
(controller/policy.py); Recovery replaces the lost workers and loads the in-memory snapshot
([Note: replace, don't restart] in worker_group/reform.py), shrinks the group to its survivors
([Note: shrink in memory]), or restarts the whole group from the last checkpoint
(``Checkpoints.load``). What it shares it writes through its owners: the position through
``Position``'s methods, the group through the Controller's ``adopt`` / ``start``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

from zeroray.config import FailureConfig, ScalingConfig
from zeroray.runtime.controller.checkpointing import Checkpoints
from zeroray.runtime.controller.policy import Action, FailurePolicy, ScalingPolicy
from zeroray.runtime.execution.pipeline import StepPipeline
from zeroray.runtime.failures import PlacementError, WorkerSetupError, is_worker_failure
from zeroray.runtime.records import RecoveryRecord, WorkerSpec
from zeroray.runtime.snapshot import Snapshot, needed_ranks
from zeroray.runtime.trainer_state import StateMachine, TrainerState
from zeroray.runtime.worker_group import reform
from zeroray.runtime.worker_group.group import WorkerGroup


class Recovery:
    """fit's recovery from worker failures: ``begin`` (a fit begins) and ``recover`` (one failure).

    ``start(n)``, ``adopt(group)`` and ``drop_broken()`` are the Controller's: it stays the one
    writer of the group it holds."""

    def __init__(self, spec: WorkerSpec, states: StateMachine, pipeline: StepPipeline, checkpoints: Checkpoints,
                 start: Callable[[int], None], adopt: Callable[[WorkerGroup], None],
                 drop_broken: Callable[[], None]) -> None:
        self.spec, self.states, self.pipeline, self.checkpoints = spec, states, pipeline, checkpoints
        self.slot, self.position = pipeline.slot, pipeline.position
        self._start, self._adopt, self._drop_broken = start, adopt, drop_broken
        self.last_recovery_s: Optional[float] = None  # fit: seconds from a worker failure to resuming
        self.recoveries: List[RecoveryRecord] = []     # fit: one record per restart (cause, timing, size)
        self.failure = FailureConfig()                 # this fit's (``begin``)
        self.policies: Optional[Tuple[FailurePolicy, ScalingPolicy]] = None  # this fit's, from its first failure
        self._fit_origin = (0, 0)                      # (step_count, data_position) where this fit began

    def begin(self, failure: FailureConfig, origin: Tuple[int, int]) -> None:
        """A fit begins at ``origin`` (step count, data position): the policies count its failures
        from its first."""
        self.failure, self.policies, self._fit_origin = failure, None, origin

    def recover(self, error: BaseException, note: Callable[[str], None], scaling_config: ScalingConfig) -> None:
        """FITTING -> RECOVERING -> FITTING: ask this fit's FailurePolicy (built at its first failure);
        raise, or rebuild the group (of the size its ScalingPolicy decides) and load the newest
        snapshot or checkpoint.

        The group already tore itself down when it raised (see [Note: failure detection] in
        worker_group/failure_detection.py). A failure while restarting (another worker dies) counts as one more.
        """
        detected = time.monotonic()
        self.scaling = scaling_config  # the Controller's, now: what a restart and a replacement place
        if self.policies is None:  # this fit's first failure: its policies count from here
            self.policies = (FailurePolicy(self.failure.max_failures),
                             ScalingPolicy(scaling_config.num_workers, scaling_config.min_workers,
                                           scaling_config.cpus_per_worker, scaling_config.use_gpu))
        failures, scaling = self.policies
        applied = self.position.step_count  # applied when the failure was seen: those past the checkpoint are redone
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
            seconds=resumed - detected, step=self.position.step_count,
            redone_steps=max(0, applied - self.position.step_count), num_workers=self.slot.get().num_workers,
            attempts=attempts, mode=mode, restored_from=restored_from, details=timings))
        note(f"zeroray: resumed at step {self.position.step_count} with {self.slot.get().num_workers} worker(s), "
             f"{self.last_recovery_s:.1f} s after the failure was detected")

    def _replace(self, scaling: ScalingPolicy, reason: str, note: Callable[[str], None]) -> Dict[str, Any]:
        """Keep the survivors, put new workers (spares first) in the lost ranks, re-form the group
        and load the snapshot into every worker ([Note: replace, don't restart] in worker_group/reform.py).
        When the new workers cannot be placed, go on with the survivors alone where the scaling
        policy allows ([Note: shrink in memory]); otherwise, or when they cannot be built, restart
        the whole group."""
        t0 = time.monotonic()
        self.pipeline.forget()
        timeout_s = self.scaling.placement_timeout_s
        try:
            timings: Dict[str, Any] = {"mode": "replace", **reform.replace(self.slot.get(), self.spec, timeout_s)}
        except (PlacementError, WorkerSetupError) as error:
            first = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            decision = scaling.on_lost(len(self.slot.get().survivors)) if isinstance(error, PlacementError) else None
            if decision is None or decision.action is not Action.RESIZE:
                note(f"zeroray: replacing the lost worker(s) failed ({first}); restarting the whole group")
                return {**self._restart(scaling, reason, note), "replace_failed": str(error).splitlines()[0]}
            note(f"zeroray: replacing the lost worker(s) failed ({first}); {decision.reason}")
            timings = {"mode": "shrink", "replace_failed": str(error).splitlines()[0],
                       **reform.shrink(self.slot.get(), self.spec, timeout_s)}
        self._adopt(self.slot.get())
        return self._restore_after_failure(reason, note, timings, time.monotonic(), t0)

    def _restart(self, scaling: ScalingPolicy, reason: str, note: Callable[[str], None]) -> Dict[str, float]:
        """Tear the group down, start one of the size the cluster offers, load the last checkpoint.
        Returns the seconds spent in each phase."""
        t0 = time.monotonic()
        self.slot.release()
        self.pipeline.forget()
        decision = scaling.on_restart(*(_free_resources(scaling) if self.scaling.placement_group is None
                                        else _given_bundles_room(self.scaling)))
        if decision.action is Action.RESIZE:
            note(f"zeroray: {decision.reason}")
        t1 = time.monotonic()
        self._start(decision.num_workers)
        t2 = time.monotonic()
        timings = {"mode": "restart", "teardown_s": t1 - t0, "start_s": t2 - t1, **self.slot.get().timings}
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
            note(f"zeroray: the in-memory snapshot of step {self.pipeline.snapshots.complete.step} is lost ({lost}); "
                 f"restarting from {self.checkpoints.last or 'the initial weights (no checkpoint yet)'} instead")
            timings["snapshot_lost"] = lost
            self.pipeline.snapshots.drop()
        timings["restored_from"] = "disk" if self.checkpoints.last is not None else "initial weights"
        if self.checkpoints.last is not None:
            self.checkpoints.load(self.checkpoints.last)
            if self.position.step_count < origin_step:
                raise RuntimeError(f"a worker failed ({reason}) and the last checkpoint ({self.checkpoints.last}, "
                                   f"step {self.position.step_count}) is older than this fit, which began at step "
                                   f"{origin_step}: the steps in between cannot be replayed. Save before fit, or set "
                                   "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
            # One global batch per step since fit began; a checkpoint from before this fit recorded
            # its position in other data, so the position is counted from the fit's origin.
            self.position.set(data_position=origin_position + self.position.step_count - origin_step)
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
        snap = self.pipeline.snapshots.complete
        if snap is None or (self.checkpoints.last_step is not None and self.checkpoints.last_step > snap.step):
            return None
        return snap

    def _restart_source(self) -> str:
        snap = self._newer_snapshot()
        if snap is not None:
            return f"the in-memory snapshot of step {snap.step}"
        return self.checkpoints.last or "the initial weights (no checkpoint yet)"

    def _load_snapshot(self, snap: Snapshot) -> Optional[str]:
        """Every new worker fetches its share of ``snap``, then (only if all could) imports it.
        None when loaded; what was lost otherwise, with the group still usable (no collective ran)."""
        group, old_layout = self.slot.get(), snap.layout
        args = []
        for info in group.setup_info:
            needed = set(needed_ranks(old_layout, info.resize_target(), info.whole_params))
            args.append((snap.layout, [ref if r in needed else None for r, ref in enumerate(snap.shards)],
                         [snap.untrained]))  # refs inside lists: each worker fetches them one at a time
        problems = group.wait_all(group.call("stage_snapshot", per_rank=args), None, "restore the in-memory snapshot",
                                  independent=True)
        lost = [f"worker {r}: {p}" for r, p in enumerate(problems) if p is not None]
        if lost:
            return "; ".join(lost)
        steps = group.wait_all(group.call("apply_snapshot"), None, "restore the in-memory snapshot")
        if steps[0] != snap.step:
            raise RuntimeError(f"the in-memory snapshot of step {snap.step} loaded as step {steps[0]}: a zeroray bug")
        self.position.set(snap.step, snap.data_position)
        return None


def _given_bundles_room(scaling: ScalingConfig) -> Tuple[float, float]:
    """CPUs and GPUs of a given placement group's worker bundles: reserved for this trainer alone,
    all free again once its group is torn down ([Note: given placement group] in
    worker_group/placement.py)."""
    return scaling.num_workers * scaling.cpus_per_worker, float(scaling.num_workers if scaling.use_gpu else 0)


def _free_resources(scaling: ScalingPolicy, wait_s: float = 3.0) -> Tuple[float, float]:
    """Free CPUs and GPUs, after giving Ray a moment to return the torn-down group's bundles."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources()
        cpus, gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
        if scaling.fits(cpus, gpus) >= scaling.target or time.monotonic() >= deadline:
            return cpus, gpus
        time.sleep(0.1)
