"""``zr.Trainer``: the user's handle on a training run.

It validates what the user passed, then hands every action to its ``Controller``
(controller/controller.py), the driver's state machine, which owns the worker group and the training
state; ``fit`` runs in fit/loop.py on the same controller. See [Note: trainer states].

[Note: releasing at exit]
A Trainer that is not shut down releases its actors and placement group when it is garbage
collected (a ``weakref.finalize``), and at interpreter exit, where the order matters: Ray
registers ``ray.shutdown`` with ``atexit`` when ``ray`` is imported, and ``weakref.finalize``
registers its own exit hook the first time any finalizer is made, which ``import torch``
already does. atexit runs hooks last-registered first, so the finalizers ran *after*
``ray.shutdown``, and ``ray.kill`` there (a ``client_mode_hook``) started a new local Ray to
run in: its core worker was then torn down by the C++ static destructors while its I/O thread
still ran, and about one exit in ten ended in a segmentation fault (exit code 139) instead of
the user's error (tests/e2e/test_exit_on_error.py). So each Trainer also registers its
finalizer with atexit itself, after Ray's hook, so that it runs first, while Ray is up; and a
release finds Ray down, it only drops the handles (the actors and placement groups went with
the cluster, or with the job's owner).
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.config import (AdamW, CheckpointConfig, FailureConfig, ScalingConfig, ZeroConfig,
                            validate_optimizer)
from zeroray.runtime.auto_stage import first_batch, resolve_stage
from zeroray.runtime.code_shipping import ship_by_value
from zeroray.runtime.controller.controller import Controller
from zeroray.runtime.fit.callbacks import Callback, Callbacks
from zeroray.runtime.fit.evaluation import FitEvaluation
from zeroray.runtime.fit.loop import run_fit
from zeroray.runtime.records import CommReport, MemoryReport, NodeInfo, RecoveryRecord, WorkerSpec
from zeroray.runtime.controller.optimizer_restore import PARTS, RestoreChoice
from zeroray.runtime.execution.step import StepResult
from zeroray.runtime.trainer_state import SHUT_DOWN, TrainerState
from zeroray.runtime.worker_group.placement import ensure_ray

__all__ = ["Trainer", "StepResult", "TrainerState"]


class Trainer:
    """ZeRO-sharded training of a PyTorch model on Ray worker actors (see the README).

    ``model_fn()`` builds the model on every worker (after ``torch.manual_seed(seed)``);
    ``loss_fn(model, batch)`` returns the scalar loss of a worker's share of a batch. ``step``
    trains on one global batch, ``fit`` on an iterable of them or a ``ray.data.Dataset``;
    ``evaluate`` computes the loss (and metrics) without training, ``run`` calls any function on
    the sharded model (inference, ``generate``);
    ``save``/``restore``/``resize`` move the sharded state; ``state_dict``/``get_parameter``
    gather it to the driver. ``trainer.controller`` is the state machine behind it all.
    """

    def __init__(self, model_fn: Callable[[], torch.nn.Module], loss_fn: Callable, *,
                 optimizer: Any = None, zero: Optional[ZeroConfig] = None,
                 scaling: Optional[ScalingConfig] = None, failure: Optional[FailureConfig] = None,
                 checkpoint: Optional[CheckpointConfig] = None, seed: int = 0,
                 param_groups: Optional[Callable[[str, torch.nn.Parameter], dict]] = None,
                 scheduler: Optional[Callable[[Any], Any]] = None, metrics_path: Optional[str] = None,
                 _restore_from: Optional[Any] = None, _restore_choice: Optional[RestoreChoice] = None) -> None:
        optimizer = _checked(model_fn, loss_fn, optimizer, zero=zero, scaling=scaling, failure=failure,
                             checkpoint=checkpoint, seed=seed)
        self.zero = zero or ZeroConfig()
        self._scaling = scaling or ScalingConfig()
        self.failure = failure or FailureConfig()
        self.checkpoint_config = checkpoint or CheckpointConfig()
        self.seed = seed
        self.metrics_path = metrics_path
        ensure_ray(self._scaling)
        self._spec = dict(model_fn=model_fn, loss_fn=loss_fn, optimizer=optimizer, seed=seed,
                          param_groups=param_groups, scheduler=scheduler)
        self._controller: Optional[Controller] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._closed = False
        self._position = 0  # data_position set before the workers started
        self._restore_choice = _restore_choice  # Trainer.restore: what the checkpoint's load takes
        self.restored_from: Optional[Any] = None  # the checkpoint directory Trainer.restore loaded
        self.skipped_checkpoints: List[Any] = []  # restore(fallback=True): SkippedCheckpoint(path, reason)s
        if self.zero.stage != "auto" or _restore_from is not None:
            self._start()  # stage="auto" waits for the first batch ([Note: stage from the first batch])
        if _restore_from is not None:
            try:
                self.controller.load(_restore_from)
            except BaseException:
                self.shutdown()  # nothing half-loaded stays behind
                raise
            self.restored_from = self.controller.last_checkpoint

    # --- the workers ([Note: stage from the first batch] in runtime/auto_stage.py) ------------

    def _start(self, batch: Any = None) -> Controller:
        """The controller, its workers started on first use: with stage="auto", at the stage chosen
        for ``batch`` (the first global batch the trainer is given, or None: not known)."""
        if self._controller is None:
            if self._closed:
                raise RuntimeError(SHUT_DOWN)
            self.zero = resolve_stage(self.zero, self._spec["model_fn"], self._scaling, self._spec["optimizer"], batch)
            spec = WorkerSpec(zero=self.zero, **self._spec)
            self._controller = Controller(spec, self._scaling, self.zero, spares=self.failure.spares)
            if self._restore_choice is not None:
                self._controller.checkpoints.restore_choice = self._restore_choice
            # Garbage collection of the Trainer releases its actors and placement group.
            self._finalizer = weakref.finalize(self, self._controller.slot.release)
            atexit.register(self._finalizer)  # before ray.shutdown at exit: [Note: releasing at exit]
            if self._position:
                self._controller.seek(self._position)
        return self._controller

    def _start_for(self, data: Any, batch_size: Optional[int] = None) -> Any:
        """Start the workers for fit's or evaluate's ``data`` (its first batch sizes stage="auto"); the
        data to use from here on (a one-shot iterator whose first batch was read is given it back)."""
        if self._controller is None and not self._closed:
            batch, data = first_batch(data, batch_size)
            self._start(batch)
        return data

    @property
    def controller(self) -> Controller:
        """The driver's state machine (controller/controller.py); reading it starts the workers."""
        return self._start()

    # --- what the trainer knows (the controller owns it) -----------------------------------

    @property
    def state(self) -> TrainerState:
        """What the trainer is doing now: idle, stepping, fitting, recovering, resizing or closed."""
        if self._controller is None:
            return TrainerState.CLOSED if self._closed else TrainerState.IDLE
        return self._controller.state

    @property
    def scaling(self) -> ScalingConfig:
        return self._scaling if self._controller is None else self._controller.scaling

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return 0 if self._controller is None else self._controller.step_count

    @property
    def data_position(self) -> int:
        """Global batches consumed from fit's data (where the next fit, or a restored checkpoint, resumes)."""
        return self._position if self._controller is None else self._controller.data_position

    @data_position.setter
    def data_position(self, value: int) -> None:
        """Where the next fit starts in its data (while idle; see Controller.seek)."""
        if self._controller is None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"data_position={value!r} must be an integer >= 0 (global batches of fit's data)")
            self._position = value
            return
        self._controller.seek(value)

    @property
    def last_recovery_s(self) -> Optional[float]:
        """fit: seconds from the last worker failure to resuming."""
        return self.controller.recovery.last_recovery_s

    @property
    def recoveries(self) -> List[RecoveryRecord]:
        """fit: one record per recovery after a worker failure (cause, timings, step, size, mode);
        read as ``rec.mode`` or ``rec["mode"]`` ([Note: records read as mappings] in records.py)."""
        return self.controller.recovery.recoveries

    @property
    def layout(self) -> FlatLayout:
        return self.controller.layout

    @property
    def num_workers(self) -> int:
        return self.controller.num_workers

    @property
    def workers(self) -> List[NodeInfo]:
        """Per worker: rank, node id, ip, pid, placement group id (where each actor runs); ``w.pid`` or
        ``w["pid"]``."""
        return list(self.controller.group.nodes)

    def shutdown(self) -> None:
        """Release the actors and the placement group. Safe to call twice."""
        self._closed = True
        if self._controller is not None:
            self._controller.close()
        if self._finalizer is not None:
            atexit.unregister(self._finalizer)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- training --------------------------------------------------------------------------

    def step(self, batch: Any) -> StepResult:
        """One optimizer step on a global batch, split over the workers (unevenly where the rows do
        not divide, each worker's loss weighted by its rows: [Note: uneven splits] in engine/batch.py)."""
        return self._start(batch).step(batch)

    def fit(self, data: Any, num_steps: Optional[int] = None, *, batch_size: Optional[int] = None,
            skip: Optional[int] = None, progress: bool = True, eval_data: Any = None,
            eval_every: Optional[int] = None, eval_metric_fn: Optional[Callable] = None,
            callbacks: Sequence[Callback] = ()) -> List[StepResult]:
        """Train on ``data``: an iterable of global batches, or a ``ray.data.Dataset`` (give batch_size).

        Runs ``num_steps`` steps (default: until the data ends). The first ``skip`` batches are
        skipped (default: ``self.data_position``, the batches a restored checkpoint had consumed).
        With CheckpointConfig(every_steps=n) it saves every n steps; with FailureConfig(max_failures=k)
        a worker failure restarts from the last checkpoint and replays the data from there. The
        next step is sent while the current one runs ([Note: pipelined steps] in fit/loop.py).

        ``eval_data``: ``evaluate(eval_data, eval_metric_fn)`` runs every ``eval_every`` steps (if
        given) and once at the end, between complete steps; a ``ray.data.Dataset`` is read in
        batches of ``batch_size``. Each evaluation goes to the progress bar or log lines, to the
        metrics file (a record with ``step``, ``eval_loss`` and ``eval_<metric>``) and to the
        ``evaluation`` of the StepResult of the step it followed.

        ``callbacks``: ``zr.Callback`` objects (the trackers of ``zeroray.tracking``, or your own)
        that fit calls on the driver as it starts, steps, evaluates, saves, recovers and ends
        (``on_step(result)`` for every step, after its checkpoint and evaluation): see
        runtime/fit/callbacks.py.
        """
        hooks = Callbacks(callbacks)
        if eval_metric_fn is not None:
            ship_by_value(eval_metric_fn)
        data = self._start_for(data, batch_size)
        return run_fit(self.controller, data, num_steps, batch_size=batch_size, skip=skip, progress=progress,
                       failure=self.failure, checkpoint=self.checkpoint_config, metrics_path=self.metrics_path,
                       evaluation=FitEvaluation.of(eval_data, eval_every, eval_metric_fn, batch_size),
                       callbacks=hooks)

    # --- evaluation and inference ([Note: inference calls] in zeroray/engine/inference.py) ----------

    def evaluate(self, data: Any, metric_fn: Optional[Callable] = None, batch_size: Optional[int] = None, *,
                 callbacks: Sequence[Callback] = ()) -> Dict[str, float]:
        """The model's loss (and metrics) on ``data``, without training: ``{"loss": ..., **metrics}``.

        ``data``: an iterable of global batches (each split over the workers as in ``step``), or a
        ``ray.data.Dataset`` read in global batches of ``batch_size`` rows (the last partial one
        dropped). Every worker runs ``loss_fn(model, its rows)``, and
        ``metric_fn(model, its rows)`` (a dict of floats or 0-dim tensors) if given, with the model
        in ``eval()`` mode under ``torch.no_grad()``. Per batch, each value is the mean over the
        workers weighted by their rows (the training loss's semantics), then the mean over the batches.
        Touches no optimizer state, step count or gradient, and leaves stage 3's prefetch trace
        as it was. ``callbacks``' ``on_evaluation(step_count, result)`` sees the result (a tracker
        logs it at the current step).
        """
        hooks = Callbacks(callbacks)
        if metric_fn is not None and not callable(metric_fn):
            raise ValueError("metric_fn must be a callable (model, batch) -> dict of name -> float, "
                             f"got {type(metric_fn).__name__}")
        if metric_fn is not None:
            ship_by_value(metric_fn)
        data = self._start_for(data, batch_size)
        metrics = self.controller.evaluate(data, metric_fn, batch_size)
        hooks.emit("evaluation", self.controller.step_count, metrics)
        return metrics

    def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(model, *args)`` on every worker with the sharded model in ``eval()`` mode under
        ``torch.no_grad()``; returns rank 0's result (its tensors on the CPU).

        For inference and sampling: ``trainer.run(lambda m, ids: m.generate(ids, max_new_tokens=20),
        ids)``. Tensors in ``args`` arrive on each worker's device. Under stage 3 every parameter
        fetch is agreed with the other workers, so the workers' ``fn`` may run different numbers
        of forwards (generation stopping at different lengths) and none waits forever on another;
        ``zeroray.worker_context()`` inside ``fn`` gives the worker's rank. An error in ``fn`` on
        any worker raises here, as a step's would. Trains nothing.
        """
        if not callable(fn):
            raise ValueError(f"run needs a callable fn(model, *args), got {type(fn).__name__}")
        ship_by_value(fn)
        return self.controller.run(fn, args)

    # --- inspection ------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Consolidated fp32 parameters (and buffers), keys as ``model_fn().state_dict()``."""
        return self.controller.state_dict()

    def get_parameter(self, name: str) -> torch.Tensor:
        """One full parameter (fp32), gathered to the driver from the shards that hold it."""
        return self.controller.parameter(name)

    def comm_report(self) -> List[CommReport]:
        """Per worker, for the last step: bytes and calls per collective, exposed wait, prefetch hits
        (an ``evaluate`` or ``run`` after that step adds its own collectives and fetches to these)."""
        return self.controller.on_workers("comm_report")

    def memory_report(self) -> List[MemoryReport]:
        """Per worker: measured bytes by category next to the paper's estimate (see memory/report.py);
        ``snapshot_bytes``: what one in-memory snapshot of that worker's state holds in Ray's object
        store under FailureConfig(snapshot_every=K), outside the worker's process (1/N of the model states)."""
        return self.controller.on_workers("memory_report")

    # --- checkpoints and resize ------------------------------------------------------------

    def save(self, path: Optional[Any] = None) -> Any:
        """Sharded checkpoint: every worker writes its shard in parallel, then an atomic commit."""
        root = path or self.checkpoint_config.path
        if root is None:
            raise ValueError("save() needs a path: trainer.save('ckpts/') or CheckpointConfig(path=...)")
        keep = self.checkpoint_config.keep if root == self.checkpoint_config.path else None
        return self.controller.save(root, keep)

    @classmethod
    def restore(cls, path: Any, model_fn: Callable, loss_fn: Callable, *, fallback: bool = False,
                fresh_optimizer: bool = False, **kwargs: Any) -> "Trainer":
        """A Trainer that continues from the checkpoint at ``path`` (a root or a step directory),
        at any number of workers and any stage, with the checkpoint's optimizer: its class,
        hyperparameters, param groups and LR scheduler state, as PyTorch's ``load_state_dict``
        restores them. ``optimizer=``, ``param_groups=`` or ``scheduler=`` replace the
        checkpoint's (the log says which hyperparameters change); the optimizer state still loads
        when it fits, and ``fresh_optimizer=True`` starts the optimizer and its scheduler over.
        See [Note: restoring the optimizer] in runtime/controller/optimizer_restore.py.

        ``fallback=True``: load the newest checkpoint under ``path`` whose files all verify
        (sizes, sha256), skipping damaged ones (and, for a step directory, trying the older ones
        beside it); ``trainer.restored_from`` says which was loaded and ``trainer.skipped_checkpoints``
        which were skipped and why (also logged as warnings). See runtime/controller/restore.py."""
        from zeroray.runtime.controller.restore import load_newest_valid, restore_choice

        # fail early, with the checkpoint's own error, before starting actors
        choice = restore_choice(path, fallback, {k: kwargs.pop(k, None) for k in PARTS}, fresh_optimizer)
        kwargs.update(optimizer=choice.optimizer, param_groups=choice.param_groups, scheduler=choice.scheduler)
        if not fallback:
            return cls(model_fn, loss_fn, _restore_from=path, _restore_choice=choice, **kwargs)
        trainer = cls(model_fn, loss_fn, _restore_choice=choice, **kwargs)
        try:
            trainer.restored_from, trainer.skipped_checkpoints = load_newest_valid(trainer.controller, path)
        except BaseException:
            trainer.shutdown()  # nothing half-loaded stays behind
            raise
        return trainer

    def resize(self, num_workers: int) -> None:
        """Change the number of workers in place: the shards move from the old actors to the new
        ones through Ray's object store (no disk); training continues where it was."""
        self.controller.resize(num_workers)


def _checked(model_fn: Any, loss_fn: Any, optimizer: Any, **configs: Any) -> Any:
    """Trainer's arguments checked, each with what was wrong and what to pass; the optimizer to use."""
    if not callable(model_fn):
        raise ValueError("model_fn must be a callable () -> torch.nn.Module (a function or class), "
                         f"got {type(model_fn).__name__}")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be a callable (model, batch) -> scalar loss tensor, "
                         f"got {type(loss_fn).__name__}")
    optimizer = AdamW() if optimizer is None else optimizer
    validate_optimizer(optimizer)
    for name, cls in (("zero", ZeroConfig), ("scaling", ScalingConfig), ("failure", FailureConfig),
                      ("checkpoint", CheckpointConfig)):
        value = configs[name]
        if value is not None and not isinstance(value, cls):
            raise ValueError(f"{name} must be a zr.{cls.__name__}(...), got {type(value).__name__}")
    if not isinstance(configs["seed"], int):
        raise ValueError(f"seed must be an int, got {configs['seed']!r}")
    return optimizer
