"""The fit loop: feed batches, checkpoint on a cadence, recover from worker failures.

[Note: data replay]
``trainer.data_position`` counts the global batches consumed from the data given to fit.
A checkpoint records it. After a failure the group is rebuilt, the last checkpoint loaded,
and the data is iterated again from its start with the first ``data_position`` batches
skipped, so every step sees the batch it would have seen without the failure. This needs
a re-iterable source (a list, a Dataset-like object with __iter__ returning a fresh iterator,
or a ray.data.Dataset); a one-shot iterator cannot be replayed and fit says so.
"""
from __future__ import annotations

import itertools
import sys
import logging
import time
from typing import Any, List, Optional

import ray

from zeroray.runtime.data import WorkerStep, worker_steps
from zeroray.runtime.policy import Action, FailurePolicy, ScalingPolicy
from zeroray.runtime.progress import Progress

log = logging.getLogger("zeroray")


def _is_ray_dataset(data: Any) -> bool:
    ray_data = sys.modules.get("ray.data")  # a Dataset exists only once ray.data was imported
    return ray_data is not None and isinstance(data, ray_data.Dataset)


def _batches(trainer, data: Any, skip: int, batch_size: Optional[int]):
    if _is_ray_dataset(data):
        # Every worker pulls its own split: the loop gets WorkerSteps, not batches (runtime/data.py).
        return worker_steps(trainer, data, batch_size, skip)
    return itertools.islice(iter(data), skip, None)


def _tokens_per_step(batch: Any) -> Optional[int]:
    import torch

    if isinstance(batch, WorkerStep):
        return batch.num_tokens
    first = batch[0] if isinstance(batch, (list, tuple)) else (
        next(iter(batch.values())) if isinstance(batch, dict) else batch)
    return int(first.numel()) if isinstance(first, torch.Tensor) else None


def run_fit(trainer, data: Any, num_steps: Optional[int], *, batch_size: Optional[int],
            skip: Optional[int], progress: bool) -> List[Any]:
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
        raise ValueError(f"num_steps={num_steps!r} must be an int >= 0, or None to run until the data ends")
    replayable = not (iter(data) is data) if not _is_ray_dataset(data) else True
    if trainer.failure.max_failures > 0 and not replayable:
        raise ValueError("fit with FailureConfig(max_failures>0) needs re-iterable data (a list, or an object "
                         "whose __iter__ starts over), so batches can be replayed after a failure; "
                         "got a one-shot iterator")
    start_position = trainer.data_position if skip is None else skip
    trainer.data_position = start_position
    trainer._fit_origin = (trainer.step_count, start_position)
    end_position = None if num_steps is None else start_position + num_steps
    ckpt = trainer.checkpoint_config
    failures = FailurePolicy(trainer.failure.max_failures)
    scaling = ScalingPolicy(trainer.scaling.num_workers, trainer.scaling.min_workers,
                            trainer.scaling.cpus_per_worker, trainer.scaling.use_gpu)
    results: List[Any] = []
    batches = _batches(trainer, data, trainer.data_position, batch_size)  # checks a Dataset's batch_size
    bar = Progress(num_steps, metrics_path=trainer.metrics_path) if progress else None
    try:
        while end_position is None or trainer.data_position < end_position:
            try:
                batch = next(batches)
            except StopIteration:
                break
            try:
                result = batch.run() if isinstance(batch, WorkerStep) else trainer.step(batch)
                trainer.data_position += 1
                results.append(result)
                if bar:
                    if bar.tokens_per_step is None:
                        bar.tokens_per_step = _tokens_per_step(batch)
                    bar.update(result)
                if ckpt.every_steps and trainer.step_count % ckpt.every_steps == 0:
                    trainer.save(ckpt.path)
            except Exception as error:  # noqa: BLE001 - classified by _recover: raise, or restart
                batches = None  # drop the iterator (a Ray Data feed detaches from the old group)
                _recover(trainer, error, failures, scaling, bar)
                results[:] = [r for r in results if r.step <= trainer.step_count]  # replayed below
                batches = _batches(trainer, data, trainer.data_position, batch_size)
    finally:
        if bar:
            bar.close()
    return results


def _recover(trainer, error: Exception, failures: FailurePolicy, scaling: ScalingPolicy, bar) -> None:
    """Ask the FailurePolicy; raise, or rebuild the group and load the last checkpoint.

    The group already tore itself down when it raised (see [Note: failure detection] in
    worker_group.py). A failure while restarting (another worker dies) counts as one more.
    """
    from zeroray.runtime.trainer import _is_worker_failure

    detected = time.monotonic()
    while True:
        decision = failures.on_failure(error, user_error=not _is_worker_failure(error))
        if decision.action is Action.RAISE:
            if failures.exhausted:
                raise RuntimeError(f"training failed: {decision.reason}; original cause: "
                                   f"{type(error).__name__}: {error}") from error
            raise error  # user code or input: the worker's own error, as it is
        _note(bar, f"zeroray: {decision.reason}; restarting from "
                   f"{trainer._last_checkpoint or 'the initial weights (no checkpoint yet)'}")
        try:
            timings = _restart(trainer, scaling, decision.reason, bar)
            break
        except Exception as again:  # noqa: BLE001
            if not _is_worker_failure(again):
                raise
            error = again
    resumed = time.monotonic()
    trainer.last_recovery_s = resumed - detected
    record = {"cause": f"{type(error).__name__}: {error}", "detected_at": detected, "resumed_at": resumed,
              "seconds": resumed - detected, "step": trainer.step_count, "num_workers": trainer.num_workers,
              **timings}
    trainer.recoveries.append(record)
    _note(bar, f"zeroray: resumed at step {trainer.step_count} with {trainer.num_workers} worker(s), "
               f"{trainer.last_recovery_s:.1f} s after the failure was detected")


def _note(bar, message: str) -> None:
    if bar:
        bar.note(message)  # prints, and logs
    else:
        log.warning(message)


def _free_resources(scaling: ScalingPolicy, wait_s: float = 3.0):
    """Free CPUs and GPUs, after giving Ray a moment to return the torn-down group's bundles."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources()
        cpus, gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
        if scaling.fits(cpus, gpus) >= scaling.target or time.monotonic() >= deadline:
            return cpus, gpus
        time.sleep(0.1)


def _restart(trainer, scaling: ScalingPolicy, reason: str, bar) -> dict:
    """Tear the group down, start a new one of the size the cluster offers, load the last checkpoint.

    Returns the seconds spent in each phase (the new group's start dominates: fresh actor
    processes import torch and build the model)."""
    t0 = time.monotonic()
    trainer.shutdown()
    decision = scaling.on_restart(*_free_resources(scaling))
    if decision.action is Action.RESIZE:
        _note(bar, f"zeroray: {decision.reason}")
    trainer._structure = None
    t1 = time.monotonic()
    trainer._start(decision.num_workers)
    t2 = time.monotonic()
    timings = {"teardown_s": t1 - t0, "start_s": t2 - t1, **trainer._group.timings}
    origin_step, origin_position = trainer._fit_origin
    if trainer._last_checkpoint is not None:
        trainer._load(trainer._last_checkpoint)
        if trainer.step_count < origin_step:
            raise RuntimeError(f"a worker failed ({reason}) and the last checkpoint ({trainer._last_checkpoint}, "
                               f"step {trainer.step_count}) is older than this fit, which began at step "
                               f"{origin_step}: the steps in between cannot be replayed. Save before fit, or set "
                               "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
        # One global batch per step since fit began; a checkpoint from before this fit recorded
        # its position in other data, so the position is counted from the fit's origin.
        trainer.data_position = origin_position + trainer.step_count - origin_step
    else:
        if origin_step != 0:
            raise RuntimeError(f"a worker failed ({reason}) and there is no checkpoint to resume from: the run "
                               f"had already trained {origin_step} steps before fit began. Set "
                               "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
        # No checkpoint yet: the fresh workers hold the initial weights (same seed); start over.
        trainer.step_count = 0
        trainer.data_position = origin_position
    timings["restore_s"] = time.monotonic() - t2
    return timings
