"""The per-rank training engine: one rank's model, storage, reducer, coordinator and optimizer.

No Ray here: the engine is plain PyTorch over a ``Group`` and is tested for exact parity in
torch processes. The Ray worker actor (runtime/worker/actor.py) only wraps it. It composes; each
part is built once, by stage where it must be ([Note: stage policy] in layout/stage.py), and the
step never asks which stage it runs:

- the model and its layout (engine/model_build.py);
- the storage of the stage family: units, master, gradient, parameter shard and gatherer
  ([Note: stage data flow] in engine/storage.py);
- the coordinator of the stage, which gathers and frees units (fetch/build.py; at stage 0 it
  only follows the step's phases);
- the gradient buckets (comm/buckets.py) fed by the parameters' hooks (engine/grad_intake.py);
- the optimizer over the master: flat pieces (engine/optim.py) or whole parameters
  (engine/shaped_optim.py), chosen once (engine/optim_choice.py); activations (engine/activations.py);
- the buffers' broadcast from rank 0 at the start of each call ([Note: buffers follow DDP] in
  engine/buffer_sync.py) and SyncBatchNorm's CPU forward ([Note: SyncBatchNorm on CPU] in
  engine/sync_batchnorm.py).

One step: every micro-batch runs ``loss_fn`` and backward with the coordinator fetching
units (fetch/unit_fetcher.py) and the buckets reducing gradients; then one status all-reduce carries the
squared gradient norm, every rank's outcome ([Note: step outcome] in errors.py) and which
parameters each rank produced a gradient for; then the optimizer updates the master, skipping
the parameters no rank used ([Note: unused parameters] in engine/flat_pieces.py), and the update is
published to the full parameters.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zeroray.comm.bucket_learning import BucketLearning
from zeroray.comm.buckets import GradBuckets, default_unit_order
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig, validate_optimizer
from zeroray.context import with_worker_context
from zeroray.engine import state, step_status, sync_batchnorm
from zeroray.engine.activations import track_activations
from zeroray.engine.batch import batch_size, part_weights, split_batch, to_device
from zeroray.engine.buffer_sync import BufferBroadcast
from zeroray.engine.grad_intake import GradIntake
from zeroray.engine.inference import evaluation, run_call
from zeroray.engine.model_build import build_model, load_saved_weights
from zeroray.engine.optim import DiskOffload, LossScaler, param_overrides
from zeroray.engine.optim_choice import build_optimizer
from zeroray.engine.optim_record import record_part
from zeroray.engine.precision import MixedPrecision, load_untrained
from zeroray.engine.step_result import StepStats, check_loss, skips
from zeroray.engine.storage import build_storage
from zeroray.errors import CollectiveError, PeerStepError
from zeroray.fetch.build import build_coordinator
from zeroray.layout.arena import FlatLayout
from zeroray.layout.stage import StagePolicy

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    """One rank's training engine over a collective ``group``; see the module docstring.

    Built on every rank with the same arguments: ``model_fn()`` after ``torch.manual_seed(seed)``
    (or sharded, stage 3), the stage policy of ``zero.stage``, and an optimizer spec applied
    to this rank's flat fp32 master. ``train_step`` is collective: every rank calls it with its
    share of the global batch."""

    def __init__(self, model_fn: Callable[[], torch.nn.Module], loss_fn: Callable, optimizer: Any,
                 zero: ZeroConfig, group: Group, *, seed: int = 0, device: Any = "cpu",
                 param_groups: Optional[Callable[[str, torch.nn.Parameter], dict]] = None,
                 scheduler: Optional[Callable[[Any], Any]] = None) -> None:
        validate_optimizer(optimizer)
        self.zero, self.group, self.loss_fn, self.optimizer_spec = zero, group, loss_fn, optimizer
        self.policy = policy = StagePolicy.for_stage(zero.stage)
        self.rank, self.world_size = group.rank, group.world_size
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[zero.dtype]
        self.step_count = 0

        self.model, self.layout, kept = build_model(model_fn, seed, zero, policy, self.world_size, self.rank,
                                                    self.device)
        named = dict(self.model.named_parameters())
        if hasattr(model_fn, "read_pieces"):
            load_saved_weights(model_fn, self.model, self.layout, named, kept)
        self.precision = MixedPrecision(self.model, self.dtype, zero.cast_buffers)
        self.precision.cast()
        # before mixed precision wraps the fp32 modules ([Note: SyncBatchNorm on CPU]): restored after it
        self._restore_sync_bn = sync_batchnorm.install(self.model, self.device)
        self._restore_precision = self.precision.wrap()  # before checkpointing wraps: restored after it
        self.sync_buffers = BufferBroadcast(self.model, group, zero.broadcast_buffers)  # [Note: buffers follow DDP]
        self.waiter = Waiter(group.blocking_waits)
        offload = self._offload(zero)
        self.storage = build_storage(policy, self.layout, named, kept, group, dtype=self.dtype, device=self.device,
                                     bucket_bytes=zero.base_bucket_bytes, wait=self.waiter,
                                     master_on_disk=offload is not None,
                                     offload_dir=offload.folder if offload is not None else None)
        s = self.storage
        self.units, self.master, self.grad, self.param_shard, self.gatherer = \
            s.units, s.master, s.grad, s.param_shard, s.gatherer
        self.reducer = GradBuckets(self.layout, group, self.grad, mode=policy.reduce,
                                   bucket_bytes=zero.base_bucket_bytes, dtype=TORCH_DTYPES[zero.reduce_dtype_name],
                                   unit_order=default_unit_order(self.layout), timed=zero.buckets_planned,
                                   wait=self.waiter, backward_collectives=sync_batchnorm.synchronises(self.model))
        # before any user callback (param_groups) may read a parameter
        self.coordinator, unit_events = build_coordinator(policy, zero, self.model, self.layout, s.units, s.gatherer,
                                                          group, self.waiter, named, self.reducer)
        overrides = param_overrides(self.layout.param_names, named, param_groups)
        # what param_groups gave each local parameter: a checkpoint records it ([Note: optimizer record])
        self.param_overrides = {name: overrides[name] for name in s.param_spans()}
        self.scheduler_fn = scheduler
        # flat pieces or whole parameters, by the optimizer ([Note: optimizer paths] in engine/optim_choice.py)
        self.optimizer = build_optimizer(optimizer, s, self.layout, overrides, group, zero, scheduler, offload)
        self.bucket_learning = BucketLearning(self.reducer, zero)
        self.grads = GradIntake(named, self.layout, self.units, self.reducer, unit_events)
        self.activations, self._restore_forwards = track_activations(
            self.model, self.units, zero.activation_checkpointing, zero.offload_activations, unit_events)
        self.scaler = (LossScaler(zero.initial_loss_scale, zero.loss_scale_growth_factor,
                                  zero.loss_scale_backoff_factor, zero.loss_scale_growth_interval,
                                  zero.min_loss_scale) if zero.dtype == "fp16" else None)

    def _offload(self, zero: ZeroConfig) -> Optional[DiskOffload]:
        """Where offload="disk" puts the optimizer state, and in mixed precision the fp32 master
        ([Note: disk offload] in offload/stepper.py, [Note: master on disk] in offload/master.py)."""
        if zero.offload is None:
            return None
        if self.device.type != "cpu":
            raise ValueError(f"ZeroConfig.offload={zero.offload!r} runs on CPU workers only for now (this worker "
                             f"computes on {self.device}): the GPU workers' tiers are not built yet; set offload=None")
        return DiskOffload(zero.offload_dir, self.rank, zero.offload_chunk_bytes)

    @property
    def whole_params(self) -> bool:
        """Whether the optimizer steps whole parameters ([Note: optimizer paths] in engine/optim_choice.py)."""
        return self.optimizer.whole_params

    def offload_stats(self) -> Dict[str, float]:
        """The disk tier's I/O totals since the engine was built (empty without offload): the
        optimizer step's, and at stage 3 the parameter shard's (``shard_*``)."""
        return {**self.optimizer.offload_stats(), **self.storage.offload_stats()}

    @property
    def activation_peak_bytes(self) -> int:
        return self.activations.peak

    # --- one step --------------------------------------------------------------------------

    @with_worker_context
    def train_step(self, batch: Any, before_update: Optional[Callable[[], None]] = None, *,
                   global_rows: Optional[int] = None) -> StepStats:
        """One optimizer step on this rank's share of the global batch (collective).

        ``global_rows``: the rows of the whole global batch, whose shares may differ by a row
        ([Note: uneven splits] in engine/batch.py); None: every rank has as many rows as this
        one. Micro-batch i's loss is weighted by ``w_i = n_i * W * k / global_rows`` (1.0 for an
        equal split), and the loss returned is ``sum_i w_i * loss_i / k``: its mean over the
        ranks is the global batch's row-weighted loss.

        ``before_update``: called after forward and backward, before anything that
        ``export_state`` reads changes (the runtime's snapshot copy of the state before this
        step runs beside forward and backward, and the update waits for it)."""
        t0 = time.perf_counter()
        k = self.zero.grad_accum_steps
        self.group.counter.reset()
        self.sync_buffers()
        # One reduction this step, over pieces that cover the gradient: it writes the gradient,
        # scaled, instead of adding into a cleared one ([Note: scaled write] in comm/buckets.py).
        written = self.reducer.covers_target and (k == 1 or not self.policy.reduce_every_micro_batch)
        if not written:
            self.grad.zero_()
        self.optimizer.prefetch()
        self.grads.begin_step()
        self.coordinator.begin_step()
        scale = self.scaler.scale if self.scaler else 1.0
        coef = 1.0 / (self.world_size * k * scale)  # the gradients are summed over ranks and micro-batches
        losses: List[torch.Tensor] = []
        failure: Optional[BaseException] = None
        done = 0
        try:
            micro = split_batch(to_device(batch, self.device), k, "worker's share of the batch (grad_accum_steps)")
            rows = [batch_size(mb) for mb in micro]
            total = sum(rows) * self.world_size if global_rows is None else global_rows
            weights = part_weights(rows, total, self.world_size * k)
            for i, mb in enumerate(micro):
                self._micro_batch(i, mb, i == k - 1, scale, weights[i], losses, coef if written else None)
                done = i + 1
        except CollectiveError:
            raise  # the group is broken: the runtime rebuilds it
        except Exception as error:  # noqa: BLE001 - the step fails on every rank; see [Note: step outcome]
            failure = error
            self._abort(done, k)
        sumsq = loss_sum = None
        if failure is None:
            if not written:  # average over ranks and micro-batches, and undo the loss scale
                self.grad.mul_(coef)
            sumsq = self.optimizer.local_sumsq()
            loss_sum = torch.stack([x.float() for x in losses]).sum()
        failed, norm, loss_value, unused = self._status(sumsq, loss_sum)
        if failed:
            self._drop_grads()
            if failure is not None:
                raise failure
            raise PeerStepError(f"step {self.step_count}: not applied, because worker(s) {failed} raised an error "
                                "during it (their own error says why)", failed)
        loss_value /= k
        if before_update is not None:
            before_update()
        skipped = skips(norm, loss_value, self.step_count, self.rank, scaled=self.scaler is not None)
        if self.scaler is not None:
            self.scaler.update(skipped, self.step_count)
        if skipped:
            self.optimizer.skip()
        else:
            self.optimizer.step(norm, unused)
            self._publish()
        self.step_count += 1
        return StepStats(loss_value, norm, self.step_count, skipped,
                         self.scaler.scale if self.scaler else None, time.perf_counter() - t0)

    def _micro_batch(self, index: int, mb: Any, last: bool, scale: float, weight: float,
                     losses: List[torch.Tensor], write_scaled: Optional[float]) -> None:
        reduce_now = self.policy.reduce_every_micro_batch or last
        self.reducer.begin_backward(accepting=reduce_now, write_scaled=write_scaled if reduce_now else None)
        self.units.expect_grads()
        self.coordinator.begin_micro_batch(index)
        self.activations.begin()
        with self.activations.hooks():
            loss = self.loss_fn(self.model, mb)
        self.activations.end_forward()
        check_loss(loss, self.step_count)
        if weight != 1.0:  # an uneven part: [Note: uneven splits] in engine/batch.py (1.0 leaves it bitwise)
            loss = loss.float() * weight
        losses.append(loss.detach())
        self.coordinator.begin_backward()
        (loss.float() * scale if self.scaler else loss).backward()
        self.coordinator.finish_backward()
        if reduce_now:
            if index > 0 and not self.policy.reduce_every_micro_batch:
                self.grads.reduce_accumulated()
            self.reducer.finish()
        self.coordinator.end_micro_batch()

    def _abort(self, current: int, k: int) -> None:
        """This rank's code raised in micro-batch ``current``: take part in every collective its
        peers still expect of the step, computing nothing ([Note: step outcome] in errors.py)."""
        for i in range(current, k):
            self.coordinator.abort_micro_batch(i)
            if self.policy.reduce_every_micro_batch or i == k - 1:
                if i > current:
                    self.reducer.begin_backward(accepting=True)
                self.reducer.finish()  # what this rank did not produce counts as zero
            self.coordinator.end_micro_batch()

    def _status(self, sumsq: Optional[torch.Tensor], loss_sum: Optional[torch.Tensor]
                ) -> Tuple[List[int], float, float, List[str]]:
        """The step's status all-reduce ([Note: step status] in engine/step_status.py): (ranks whose step
        failed, global gradient norm, this rank's summed micro-batch losses, the parameters no
        rank produced a gradient for). ``sumsq`` and ``loss_sum`` are None when this rank's step
        failed."""
        W, used = self.world_size, self.grads.used
        counted = sumsq if self.storage.counts_norm else None
        vec = step_status.encode(W, self.rank, counted, loss_sum, self.coordinator.status(),
                                 self.bucket_learning.arrivals(), self.device, used=list(used.values()))
        if W > 1:
            self.waiter.until_complete(self.group.all_reduce(vec, async_op=True, control=True))
        status = step_status.decode(vec.tolist(), W, num_params=len(used))
        failed = status.failed
        self.coordinator.end_step(failed=bool(failed), any_exit=status.any_exit, agreed=status.agreed)
        self.bucket_learning.after_step(self.step_count + 1, status.extra, W,
                                        learn=not failed and not status.any_exit)
        return failed, status.norm, status.ranks[self.rank].loss, status.unused(list(used))

    def bucket_stats(self) -> Dict[str, Any]:
        """The gradient buckets of the last step (see BucketLearning.stats)."""
        return self.bucket_learning.stats()

    def _drop_grads(self) -> None:
        self.grad.zero_()
        for p in self.model.parameters():
            p.grad = None

    def _publish(self) -> None:
        """Make the updated master visible to compute (engine/storage.py's ``publish``)."""
        self.flush()
        self.storage.publish(self.coordinator)

    def flush(self) -> None:
        """Wait for every parameter gather still in flight (stages 1-2, [Note: deferred publish] in fetch/publish.py)."""
        with torch.no_grad():
            self.coordinator.flush()

    def fetch_stats(self) -> Dict[str, Any]:
        """Stage 3's fetch counters of the last step (empty at stages 0-2: their coordinators count nothing)."""
        return dict(self.coordinator.stats)

    # --- evaluation and inference: [Note: inference calls] in engine/inference.py -------------------

    @with_worker_context
    def evaluate(self, batch: Any, metric_fn: Optional[Callable] = None) -> Dict[str, float]:
        """``loss_fn`` (and ``metric_fn``) on this rank's rows, in eval mode without gradients:
        ``{"loss": float, **metrics}`` (collective; trains nothing)."""
        self.sync_buffers()
        return run_call(self.model, self.coordinator, self.group, self.waiter, self.device,
                        evaluation(self.loss_fn, metric_fn), batch)

    @with_worker_context
    def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(model, *args)`` in eval mode without gradients; its result with every tensor on the
        CPU. Tensors in ``args`` arrive on this rank's device (collective; trains nothing)."""
        self.sync_buffers()
        return run_call(self.model, self.coordinator, self.group, self.waiter, self.device, fn, *args)

    # --- inspection and state: engine/state.py, in the storage's coordinates ----------------

    def master_piece(self, name: str) -> Tuple[int, int, torch.Tensor]:
        """(lo, hi, fp32 values) of parameter ``name``'s flat elements held by this rank."""
        return self.storage.master_piece(name)

    def master_shard(self) -> torch.Tensor:
        """This rank's fp32 master in the layout's shard coordinates (all stages alike)."""
        return self.storage.master_shard()

    def export_state(self, live: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Flat fp32 tensors in this rank's shard coordinates, and per-rank scalars. Copies, or,
        ``live``, the engine's own tensors where they already are such flat tensors (the stage-3
        or mixed-precision master, the optimizer's flat state: [Note: flat optimizer state] in
        engine/flat_state.py), which the next update changes in place: the in-memory snapshot
        returns them, and the update waits until Ray has stored them ([Note: overlapped snapshot
        copy] in runtime/snapshot.py)."""
        return state.export_state(self.storage, self.optimizer, self.step_count, self.scaler, live)

    def optimizer_record(self) -> Dict[str, Any]:
        """This rank's part of the optimizer record a checkpoint holds ([Note: optimizer record]
        in engine/optim_record.py): its param groups' values now, and the spec's as built."""
        opt = self.optimizer
        return record_part(opt.builder, self.scheduler_fn, opt.groups_by_key(), opt.scheduler, self.param_overrides,
                           self.device)

    def state_layout(self) -> Tuple[FlatLayout, int]:
        """The (layout, rank) whose shard coordinates import_state expects: stage 0 wants everything."""
        return self.storage.state_layout()

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load tensors given in ``state_layout()`` coordinates (collective for stages 1-2)."""
        self.flush()
        self.step_count = state.import_state(self.storage, self.optimizer, self.scaler, tensors, scalars)
        self._publish()
        self.flush()

    def untrained_state(self) -> Dict[str, torch.Tensor]:
        """Frozen parameters and buffers (replicated), under their state_dict names, each in the
        dtype the model gave it ([Note: mixed precision] in engine/precision.py)."""
        trained = set(self.layout.slots)
        # keep_vars: the trainable parameters are not touched (at stage 3 they hold no values here)
        return {k: self.precision.exported(k, v) for k, v in self.model.state_dict(keep_vars=True).items()
                if k not in trained}

    def import_untrained(self, tensors: Dict[str, torch.Tensor]) -> List[str]:
        """Load what ``untrained_state`` exported (a checkpoint's extra tensors), each cast into
        the engine's dtype for it; returns the names ``tensors`` lacks."""
        return load_untrained(self.model, tensors, skip=self.layout.slots)

    def close(self) -> None:
        """Release everything the engine attached to the model, so that it and its memory can go."""
        self.flush()
        self.grads.remove()
        self.coordinator.remove()  # its parameter access too
        self._restore_forwards()
        self._restore_precision()
        self._restore_sync_bn()
        self.activations.inner = None
        self.optimizer.close()
        self.storage.close()
