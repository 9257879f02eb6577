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
import logging
import time
from typing import Any, List, Optional

import ray

from zeroray.runtime.policy import Action, FailurePolicy, ScalingPolicy
from zeroray.runtime.progress import Progress

log = logging.getLogger("zeroray")


def _is_ray_dataset(data: Any) -> bool:
    try:
        import ray.data

        return isinstance(data, ray.data.Dataset)
    except ImportError:
        return False


def _batches(data: Any, skip: int, batch_size: Optional[int]):
    if _is_ray_dataset(data):
        if batch_size is None:
            raise ValueError("fit(dataset) with a ray.data.Dataset needs batch_size= (the global batch size)")
        it = data.iter_torch_batches(batch_size=batch_size, drop_last=True)
    else:
        it = iter(data)
    return itertools.islice(it, skip, None)


def _tokens_per_step(batch: Any) -> Optional[int]:
    import torch

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
    bar = Progress(num_steps, metrics_path=trainer.metrics_path) if progress else None
    batches = _batches(data, trainer.data_position, batch_size)
    try:
        while end_position is None or trainer.data_position < end_position:
            try:
                batch = next(batches)
            except StopIteration:
                break
            try:
                result = trainer.step(batch)
            except Exception as error:  # noqa: BLE001 - classified below
                from zeroray.runtime.trainer import _is_worker_failure

                decision = failures.on_failure(error, user_error=not _is_worker_failure(error))
                if decision.action is Action.RAISE:
                    if failures.failures > trainer.failure.max_failures and failures.failures > 0:
                        raise RuntimeError(f"training failed: {decision.reason}; original cause: "
                                           f"{type(error).__name__}: {error}") from error
                    raise
                t0 = time.perf_counter()
                _recover(trainer, scaling, decision.reason, bar)
                batches = _batches(data, trainer.data_position, batch_size)
                msg = (f"zeroray: restarted after a worker failure ({decision.reason}); resumed at step "
                       f"{trainer.step_count} with {trainer.num_workers} worker(s) in {time.perf_counter() - t0:.1f}s")
                trainer.last_recovery_s = time.perf_counter() - t0
                if bar:
                    bar.note(msg)
                else:
                    log.warning(msg)
                continue
            trainer.data_position += 1
            results.append(result)
            if bar:
                if bar.tokens_per_step is None:
                    bar.tokens_per_step = _tokens_per_step(batch)
                bar.update(result)
            if ckpt.every_steps and trainer.step_count % ckpt.every_steps == 0:
                trainer.save(ckpt.path)
    finally:
        if bar:
            bar.close()
    return results


def _recover(trainer, scaling: ScalingPolicy, reason: str, bar) -> None:
    """Tear the group down, start a new one of the size the cluster offers, load the last checkpoint."""
    log.warning("zeroray: worker failure: %s; restarting", reason)
    trainer.shutdown()
    time.sleep(1.0)  # let Ray return the dead group's resources before sizing the new one
    free = ray.available_resources()
    n = scaling.workers_for(free.get("CPU", 0.0), free.get("GPU", 0.0))
    trainer._structure = None
    trainer._start(n)
    if trainer._last_checkpoint is not None:
        trainer._load(trainer._last_checkpoint)
    else:
        origin_step, origin_position = trainer._fit_origin
        if origin_step != 0:
            raise RuntimeError(f"a worker failed ({reason}) and there is no checkpoint to resume from: the run "
                               f"had already trained {origin_step} steps before fit began. Set "
                               "CheckpointConfig(path=..., every_steps=...) so fit can recover.")
        # No checkpoint yet: the fresh workers hold the initial weights (same seed); start over.
        trainer.step_count = 0
        trainer.data_position = origin_position
