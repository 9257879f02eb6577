"""The driver-side controller: ``zr.Trainer``.

A small state machine (Ray Train v2 style): it owns one WorkerGroup at a time, splits
global batches over it, and on a worker failure asks the FailurePolicy what to do,
rebuilds the group (as many workers as the cluster offers, down to min_workers), restores
the last checkpoint and replays the data from there.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from zeroray.arena import FlatLayout
from zeroray.config import (AdamW, CheckpointConfig, FailureConfig, ScalingConfig, ZeroConfig,
                            validate_optimizer)
from zeroray.engine import batch_size, batch_structure, split_batch, structure_changed
from zeroray.runtime.batch_transport import PackedBatch
from zeroray.runtime.worker_group import WorkerGroup, ensure_ray

log = logging.getLogger("zeroray")


@dataclass
class StepResult:
    loss: float            # mean over the global batch
    grad_norm: float       # global L2 norm before clipping
    step: int              # optimizer steps taken so far (this one included)
    skipped: bool = False  # fp16 overflow: the update was skipped on every worker
    loss_scale: Optional[float] = None
    step_time_s: float = 0.0
    timeline: Optional[Dict[str, float]] = field(default=None, repr=False, compare=False)


def _is_worker_failure(error: BaseException) -> bool:
    """A dead, unreachable or hung worker (restartable), as opposed to an error in user code or input.

    A surviving rank whose peer died fails inside gloo/NCCL; that is the peer's failure, not user
    error. The classification lives with the group (worker_group.classify_error)."""
    from zeroray.runtime.worker_group import classify_error

    return classify_error(error) != "user"


def _finalize(group_ref: List[Optional[WorkerGroup]]) -> None:
    group = group_ref[0]
    if group is not None:
        group.shutdown()
        group_ref[0] = None


class Trainer:
    def __init__(self, model_fn: Callable[[], torch.nn.Module], loss_fn: Callable, *,
                 optimizer: Any = None, zero: Optional[ZeroConfig] = None,
                 scaling: Optional[ScalingConfig] = None, failure: Optional[FailureConfig] = None,
                 checkpoint: Optional[CheckpointConfig] = None, seed: int = 0,
                 param_groups: Optional[Callable[[str, torch.nn.Parameter], dict]] = None,
                 scheduler: Optional[Callable[[Any], Any]] = None, metrics_path: Optional[str] = None,
                 _restore_from: Optional[str] = None) -> None:
        if not callable(model_fn):
            raise ValueError("model_fn must be a callable () -> torch.nn.Module (a function or class), "
                             f"got {type(model_fn).__name__}")
        if not callable(loss_fn):
            raise ValueError("loss_fn must be a callable (model, batch) -> scalar loss tensor, "
                             f"got {type(loss_fn).__name__}")
        optimizer = AdamW() if optimizer is None else optimizer
        validate_optimizer(optimizer)
        for name, value, cls in (("zero", zero, ZeroConfig), ("scaling", scaling, ScalingConfig),
                                 ("failure", failure, FailureConfig), ("checkpoint", checkpoint, CheckpointConfig)):
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be a zr.{cls.__name__}(...), got {type(value).__name__}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.zero = zero or ZeroConfig()
        self.scaling = scaling or ScalingConfig()
        self.failure = failure or FailureConfig()
        self.checkpoint_config = checkpoint or CheckpointConfig()
        self.seed = seed
        self.metrics_path = metrics_path
        self._spec = {"model_fn": model_fn, "loss_fn": loss_fn, "optimizer": optimizer, "zero": self.zero,
                      "seed": seed, "param_groups": param_groups, "scheduler": scheduler}
        self.step_count = 0
        self.data_position = 0
        self._structure = None
        self._last_checkpoint: Optional[str] = None
        self.last_recovery_s: Optional[float] = None  # fit: seconds from a worker failure to resuming
        self.recoveries: List[Dict[str, Any]] = []     # fit: one record per restart (cause, timing, size)
        self._group_ref: List[Optional[WorkerGroup]] = [None]
        ensure_ray(self.scaling)
        self._start(self.scaling.num_workers)
        # Garbage collection of the Trainer releases its actors and placement group.
        self._finalizer = weakref.finalize(self, _finalize, self._group_ref)
        if _restore_from is not None:
            try:
                self._load(_restore_from)
            except BaseException:
                self.shutdown()  # nothing half-loaded stays behind
                raise

    # --- group lifecycle -------------------------------------------------------------------

    @property
    def _group(self) -> WorkerGroup:
        group = self._group_ref[0]
        if group is None:
            raise RuntimeError("this Trainer was shut down: build a new one (or zr.Trainer.restore(...))")
        return group

    @property
    def num_workers(self) -> int:
        return self._group.num_workers

    @property
    def workers(self) -> List[Dict[str, Any]]:
        """Per worker: rank, node id, ip, pid (where each actor runs)."""
        return list(self._group.nodes)

    def _start(self, num_workers: int) -> None:
        self._group_ref[0] = WorkerGroup(self._spec, num_workers, self.scaling)
        info = self._group.setup_info[0]
        self.layout = FlatLayout.from_dict(info["layout"])
        self._state_dict_keys = info["state_dict_keys"]

    def shutdown(self) -> None:
        """Release the actors and the placement group. Safe to call twice."""
        _finalize(self._group_ref)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- training --------------------------------------------------------------------------

    def _check_batch(self, batch: Any) -> None:
        structure = batch_structure(batch)
        if self._structure is not None and structure != self._structure:
            raise ValueError(structure_changed(self.step_count, self._structure, structure))
        size = batch_size(batch)
        parts = self.num_workers * self.zero.grad_accum_steps
        if size % parts:
            raise ValueError(
                f"the global batch has {size} rows, which does not split evenly over {self.num_workers} worker(s)"
                f" x {self.zero.grad_accum_steps} micro-batch(es): use a batch size divisible by {parts}")
        self._structure = structure

    def step(self, batch: Any) -> StepResult:
        """One optimizer step on a global batch (split evenly over the workers)."""
        self._check_batch(batch)
        shards = [PackedBatch(s) for s in split_batch(batch, self.num_workers)]  # [Note: batch transport]
        submit = time.time()
        refs = self._group.call_each("train_step", [(s,) for s in shards])
        results = self._group.wait_all(refs, self.zero.collective_timeout_s + 60, f"step {self.step_count}")
        out = self._record_step(results)
        out.timeline = {"submit": submit, **results[0]["hops"], "receive": time.time()}
        return out

    def _record_step(self, results: List[Dict[str, Any]]) -> StepResult:
        """The StepResult of the workers' per-rank results (shared with Ray Data's runtime/data.py)."""
        self.step_count = results[0]["step"]
        r0 = results[0]
        return StepResult(loss=sum(r["loss"] for r in results) / len(results), grad_norm=r0["grad_norm"],
                          step=r0["step"], skipped=r0["skipped"], loss_scale=r0["loss_scale"],
                          step_time_s=max(r["time_s"] for r in results))

    def fit(self, data: Any, num_steps: Optional[int] = None, *, batch_size: Optional[int] = None,
            skip: Optional[int] = None, progress: bool = True) -> List[StepResult]:
        """Train on ``data``: an iterable of global batches, or a ``ray.data.Dataset`` (give batch_size).

        Runs ``num_steps`` steps (default: until the data ends). The first ``skip`` batches are
        skipped (default: ``self.data_position``, the batches a restored checkpoint had consumed).
        With CheckpointConfig(every_steps=n) it saves every n steps; with FailureConfig(max_failures=k)
        a worker failure restarts from the last checkpoint and replays the data from there.
        """
        from zeroray.runtime.fit_loop import run_fit

        return run_fit(self, data, num_steps, batch_size=batch_size, skip=skip, progress=progress)

    # --- inspection ------------------------------------------------------------------------

    def _assemble(self, names: List[str]) -> Dict[str, torch.Tensor]:
        pieces = self._group.wait_all(self._group.call("master_pieces", names), None, "gather parameters")
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

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Consolidated fp32 parameters (and buffers), keys as ``model_fn().state_dict()``."""
        params = self._assemble(self.layout.param_names)
        untrained = self._group.wait_all(self._group.call("untrained_state", ranks=[0]), None, "state")[0]
        out = {}
        for key in self._state_dict_keys:
            if key in self.layout.slots:
                out[key] = params[self.layout.slots[key].name].clone()
            elif key in untrained:
                out[key] = untrained[key]
        return out

    def get_parameter(self, name: str) -> torch.Tensor:
        """One full parameter (fp32), gathered to the driver from the shards that hold it."""
        if name in self.layout.slots:
            return self._assemble([self.layout.slots[name].name])[self.layout.slots[name].name]
        untrained = self._group.wait_all(self._group.call("untrained_state", ranks=[0]), None, "state")[0]
        if name in untrained:
            return untrained[name]
        raise KeyError(f"no parameter or buffer named {name!r}; names are those of model.state_dict(), "
                       f"e.g. {self._state_dict_keys[:5]}")

    def comm_report(self) -> List[Dict[str, Any]]:
        """Per worker, for the last step: bytes and calls per collective, exposed wait, prefetch hits."""
        return self._group.wait_all(self._group.call("comm_report"), None, "comm_report")

    def memory_report(self) -> List[Dict[str, Any]]:
        """Per worker: measured bytes by category next to the paper's estimate (see memory_report.py)."""
        return self._group.wait_all(self._group.call("memory_report"), None, "memory_report")

    # --- checkpoints and resize ------------------------------------------------------------

    def save(self, path: Optional[str] = None) -> str:
        """Sharded checkpoint: every worker writes its shard in parallel, then an atomic commit."""
        from zeroray.checkpoint import commit

        root = path or self.checkpoint_config.path
        if root is None:
            raise ValueError("save() needs a path: trainer.save('ckpts/') or CheckpointConfig(path=...)")
        outs = self._group.wait_all(self._group.call("save_shard", root, self.step_count), None, "save")
        infos = [o[0] for o in outs] + [o[1] for o in outs if o[1] is not None]
        fields = {"layout": self.layout, "world_size": self.num_workers, "data_position": self.data_position,
                  "config": {"zero": repr(self.zero), "scaling": repr(self.scaling), "seed": self.seed},
                  "extra": {"state_dict_keys": self._state_dict_keys}}
        keep = self.checkpoint_config.keep if root == self.checkpoint_config.path else None
        self._last_checkpoint = commit(root, self.step_count, fields, infos, keep=keep)
        return self._last_checkpoint

    def _load(self, path: str) -> None:
        from zeroray.checkpoint import latest_checkpoint, load_manifest

        manifest = load_manifest(path)
        step_dir = manifest.source if hasattr(manifest, "source") else (latest_checkpoint(path) or path)
        steps = self._group.wait_all(self._group.call("load_checkpoint", step_dir), None, "restore")
        self.step_count = steps[0]
        self.data_position = int(manifest.data_position or 0)
        self._last_checkpoint = step_dir

    @classmethod
    def restore(cls, path: str, model_fn: Callable, loss_fn: Callable, **kwargs: Any) -> "Trainer":
        """A Trainer that continues from the checkpoint at ``path`` (a root or a step directory),
        at any number of workers and any stage."""
        from zeroray.checkpoint import load_manifest

        load_manifest(path)  # fail early, with the checkpoint's own error, before starting actors
        return cls(model_fn, loss_fn, _restore_from=path, **kwargs)

    def resize(self, num_workers: int) -> None:
        """Change the number of workers in place: shards move from the old actors to the new ones
        through Ray's object store (no disk); training continues where it was."""
        ScalingConfig(num_workers=num_workers)  # validates
        old = self._group
        state_refs = old.call("export_state")
        import ray

        ray.wait(state_refs, num_returns=len(state_refs))
        old_layout = self.layout.to_dict()
        # The exported states are owned by this driver and live in the object store, so they
        # outlive the old actors; each new worker fetches them directly (nested refs).
        old.shutdown()
        self._group_ref[0] = None
        self.scaling = ScalingConfig(**{**vars(self.scaling), "num_workers": num_workers,
                                        "min_workers": min(self.scaling.min_workers or num_workers, num_workers)})
        self._start(num_workers)
        steps = self._group.wait_all(self._group.call("load_from_states", old_layout, state_refs), None, "resize")
        self.step_count = steps[0]
