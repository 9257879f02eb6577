"""The per-rank training engine: one rank's model, units, reducer, coordinator and optimizer.

No Ray here: the engine is plain PyTorch over a ``Group`` and is tested for exact parity in
torch processes. The Ray worker actor (runtime/worker.py) only wraps it.

[Note: stage data flow]
Tensors per rank (Φ trainable elements, W workers, "shard" = ``layout.shard_numel``):

stage | full params (compute dtype)     | local param shard          | fp32 grad    | fp32 master + optimizer
0     | persistent arena                | -                          | full         | full
1, 2  | persistent arena                | the arena's rows (no copy) | shard        | shard
3     | per unit, gathered on demand    | shard                      | shard        | shard

At stages 1-2 the local shard is this rank's rows of the arena ([Note: local shard] in
layout/local_shard.py): the gather source, updated in place. In fp32 the master is the parameter
tensor itself (those rows at stages 1-2, the local shard at stage 3, the arena at stage 0):
no copy; in mixed precision it is a contiguous fp32 shard. Gradients leave autograd
through a post-accumulate hook and go straight into the coalescing buckets
(comm/buckets.py), which all-reduce (stage 0) or reduce-scatter (stages 1-3) them into the
fp32 gradient. Stages 0 and 1 with gradient accumulation let autograd accumulate full
gradients locally and reduce once, on the last micro-batch (also those of parameters that
micro-batch did not use); stages 2 and 3 reduce-scatter
every micro-batch into the fp32 shard, so the accumulated gradient only ever exists as the
owner's shard ([Note: stage policy]).

One step: every micro-batch runs ``loss_fn`` and backward with the coordinator fetching
units (fetch/coordinator.py) and the buckets reducing gradients; then one status all-reduce carries the
squared gradient norm, every rank's outcome ([Note: step outcome] in errors.py) and which
parameters each rank produced a gradient for; then the optimizer updates the master, skipping
the parameters no rank used ([Note: unused parameters] in engine/flat_pieces.py), and the update is
published to the full parameters.
"""
from __future__ import annotations

import base64
import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zeroray.engine import step_status
from zeroray.fetch.access import ParameterAccess
from zeroray.engine.activations import ActivationTracker, apply_checkpointing, checkpoint_targets
from zeroray.layout.arena import FlatLayout
from zeroray.engine.batch import batch_size, split_batch, to_device  # noqa: F401 (re-exported)
from zeroray.comm.bucket_learning import BucketLearning
from zeroray.comm.buckets import GradBuckets, default_unit_order
from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig, validate_optimizer
from zeroray.context import with_worker_context
from zeroray.errors import CollectiveError, PeerStepError, StepError
from zeroray.fetch.coordinator import FetchCoordinator
from zeroray.fetch.factory import build_coordinator
from zeroray.fetch.hooks import HookedModules
from zeroray.engine.inference import evaluation, failed_ranks, inference_call, to_cpu
from zeroray.layout.local_shard import LocalShard
from zeroray.memory.process import MappedBlocks
from zeroray.engine.optim import LossScaler, ShardedOptimizer, build_segments
from zeroray.engine.precision import MixedPrecision, load_untrained
from zeroray.construct.sharded_init import build_sharded
from zeroray.layout.stage import StagePolicy
from zeroray.fetch.unit import Units

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

log = logging.getLogger("zeroray")


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    step: int
    skipped: bool
    loss_scale: Optional[float]
    time_s: float


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
        self.policy = StagePolicy.for_stage(zero.stage)
        self.rank, self.world_size = group.rank, group.world_size
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[zero.dtype]
        self.reduce_dtype = TORCH_DTYPES[zero.reduce_dtype_name]
        self.step_count = 0
        self._hooks: list = []

        model, kept = self._build_model(model_fn, seed)
        named = dict(self.model.named_parameters())
        if hasattr(model_fn, "read_pieces"):
            self._load_saved_weights(model_fn, named, kept)
        self.precision = MixedPrecision(self.model, self.dtype, zero.cast_buffers)
        self.precision.cast()
        self._restore_precision = self.precision.wrap()  # before checkpointing wraps: restored after it
        self._build_storage(named, kept)
        self.waiter = Waiter(group.blocking_waits)
        self.coordinator: Optional[FetchCoordinator] = None
        self.access: Optional[ParameterAccess] = None
        if self.policy.keeps_param_shard:
            self._build_coordinator(named)  # before any user callback may read a parameter
        self._build_optimizer(optimizer, named, param_groups, scheduler)
        self.reducer = GradBuckets(self.layout, group, self.grad, mode=self.policy.reduce,
                                   bucket_bytes=zero.base_bucket_bytes, dtype=self.reduce_dtype,
                                   unit_order=default_unit_order(self.layout),
                                   timed=zero.buckets_planned)
        self.reducer.wait = self.waiter
        self.bucket_learning = BucketLearning(self.reducer, zero)
        self._register_grad_hooks(named)
        self._build_activations()
        self.scaler = (LossScaler(zero.initial_loss_scale, zero.loss_scale_growth_factor,
                                  zero.loss_scale_backoff_factor, zero.loss_scale_growth_interval,
                                  zero.min_loss_scale) if zero.dtype == "fp16" else None)

    # --- construction ----------------------------------------------------------------------

    def _build_model(self, model_fn, seed: int) -> Tuple[torch.nn.Module, Optional[dict]]:
        wrap, world = self.zero.wrap, self.world_size
        built = None
        if self.policy.reshard_after_use and self.zero.sharded_init:
            built = build_sharded(model_fn, seed, world, self.rank,
                                  layout_fn=lambda m: FlatLayout.from_module(m, world, wrap))
        if built is not None:
            model, self.layout, kept = built
        else:
            torch.manual_seed(seed)
            model, kept = model_fn(), None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
        self.model = model.to(self.device)
        if built is None:
            self.layout = FlatLayout.from_module(self.model, world, wrap)
        if not self.layout.units:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False): "
                             "there is nothing to train")
        return self.model, kept

    def _load_saved_weights(self, model_fn, named: Dict[str, torch.nn.Parameter],
                            kept: Optional[Dict[str, Tuple[int, int, torch.Tensor]]]) -> None:
        """A ``model_fn`` that carries saved weights (``zeroray.hf.pretrained``): overwrite the
        initial values with them, each rank reading only what it holds ([Note: the sliced loading
        contract] in zeroray/hf): its slice of each trainable parameter when built sharded (into
        the kept slices, in place), the whole parameter otherwise; replicated tensors whole."""
        layout = self.layout
        aliases = {n: list(layout.slots[n].aliases) for n in layout.param_names}
        if kept is not None:
            model_fn.read_pieces({n: kept[n][:2] for n in layout.param_names}, aliases,
                                 out={n: kept[n][2] for n in layout.param_names})
        else:
            with torch.no_grad():
                model_fn.read_pieces({n: (0, named[n].numel()) for n in layout.param_names}, aliases,
                                     out={n: named[n].detach().view(-1) for n in layout.param_names})
        state = self.model.state_dict(keep_vars=True)
        replicated = [k for k in state if k not in layout.slots]
        with torch.no_grad():
            for name, value in model_fn.read_whole(replicated).items():
                state[name].copy_(value.to(state[name].dtype))

    def _build_storage(self, named: Dict[str, torch.nn.Parameter],
                       kept: Optional[Dict[str, Tuple[int, int, torch.Tensor]]] = None) -> None:
        """The units' buffers, the master, the parameter shard and the gradient of [Note: stage
        data flow]; every tensor the step needs that the optimizer does not allocate itself."""
        layout, fp32, policy = self.layout, self.dtype == torch.float32, self.policy
        # The fp32 initial values of the rank's shard, taken before bind rebinds the parameters:
        # the master of stage 3 and of mixed precision at stages 1-2. fp32 stages 0-2 need none,
        # their master is the arena itself or its rows ([Note: local shard] in layout/local_shard.py).
        init_shard = None
        if policy.reshard_after_use or (policy.keeps_param_shard and not fp32):
            init_shard = self._initial_shard(named, kept)
        # Stage 3 on CPU: unit buffers off the heap ([Note: process memory] in memory/process.py).
        mapped = MappedBlocks().mapped if policy.reshard_after_use and self.device.type == "cpu" else None
        self.units = Units(layout, self.dtype, self.device, persistent=not policy.reshard_after_use, mapped=mapped)
        self.units.bind(named, copy_values=kept is None)
        if not policy.keeps_param_shard:  # stage 0
            self.param_shard = None
            arena = self.units.arena
            self.master = LocalShard.contiguous(arena if fp32 else arena.float())             # 1D full fp32
            self.grad = torch.zeros(layout.full_numel, dtype=torch.float32, device=self.device)  # 1D full
        elif not policy.reshard_after_use:  # stages 1-2: the shard is the arena's rows
            self.param_shard = LocalShard.arena_rows(layout, self.units.arena, self.rank)      # 1D shard
            self.master = self.param_shard if fp32 else LocalShard.contiguous(init_shard)    # 1D shard fp32
            self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)  # 1D shard
        else:  # stage 3
            self.master = LocalShard.contiguous(init_shard)                                   # 1D shard fp32
            self.param_shard = self.master if fp32 else LocalShard.contiguous(init_shard.to(self.dtype))
            self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)  # 1D shard
        self.gatherer = UnitGatherer(layout, self.group, self.param_shard, self.zero.base_bucket_bytes) \
            if self.param_shard is not None else None

    def _initial_shard(self, named: Dict[str, torch.nn.Parameter],
                       kept: Optional[Dict[str, Tuple[int, int, torch.Tensor]]]) -> torch.Tensor:
        """This rank's fp32 shard of the initial values (1D), from the kept slices of a sharded
        build (which arrive laid out as the shard: that arena is adopted, not copied) or from
        the whole parameters."""
        layout = self.layout
        shard = _adopt_kept_arena(layout, kept, self.rank, self.device) if kept is not None else None
        if shard is None:
            shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)
        for name in layout.param_names:
            piece, lo, hi = layout.param_shard_view(shard, name, self.rank)
            if hi > lo:
                # pop: each kept slice that is not in place is freed once copied
                values = kept.pop(name)[2] if kept is not None else named[name].detach().reshape(-1)[lo:hi]
                if values.data_ptr() != piece.data_ptr():
                    piece.copy_(values.float())
        return shard

    def _local_spans(self, named, param_groups) -> List[Tuple[int, int, dict]]:
        """(start, end, overrides) of each parameter's piece in the master tensor, in order."""
        spans = []
        for name, (start, end) in self._param_spans().items():
            overrides = dict(param_groups(name, named[name]) or {}) if param_groups else {}
            if "params" in overrides:
                raise ValueError(f"param_groups({name!r}) returned a 'params' key: return only the "
                                 "overrides (lr, weight_decay, ...) for that parameter")
            spans.append((start, end, overrides))
        return spans

    def _param_spans(self) -> Dict[str, Tuple[int, int]]:
        """[start, end) of each parameter's piece in the master tensor, in order (the pieces this
        rank holds: all at stage 0)."""
        spans = {}
        for name in self.layout.param_names:
            slot = self.layout.slots[name]
            if not self.policy.keeps_param_shard:
                start = self.layout.units[slot.unit].full_offset + slot.offset
                spans[name] = (start, start + slot.numel)
            else:
                start, lo, hi = self.layout.param_shard_range(name, self.rank)
                if hi > lo:
                    spans[name] = (start, start + hi - lo)
        return spans

    def _build_optimizer(self, spec, named, param_groups, scheduler) -> None:
        segments = build_segments(self._local_spans(named, param_groups), self.master.numel(),
                                  breaks=self.master.breaks())
        self.optimizer = ShardedOptimizer(spec, self.master, self.grad, segments, self.zero.max_grad_norm, scheduler,
                                          param_spans=self._param_spans())

    def _hooked_modules(self) -> Tuple[List[torch.nn.Module], List[str], List[Tuple[int, ...]]]:
        """Each module object whose forward needs units (once, under its first name) and those units."""
        modules, names, needs = [], [], []
        by_name = dict(self.model.named_modules(remove_duplicate=False))
        index_of: Dict[int, int] = {}
        for mname, unit_ids in self.layout.module_units.items():
            module = by_name[mname]
            if id(module) in index_of:  # one module object registered under two names
                i = index_of[id(module)]
                needs[i] = tuple(sorted(set(needs[i]) | set(unit_ids)))
                continue
            index_of[id(module)] = len(modules)
            modules.append(module)
            names.append(mname)
            needs.append(tuple(unit_ids))
        return modules, names, needs

    def _build_coordinator(self, named: Dict[str, torch.nn.Parameter]) -> None:
        self.gatherer.wait = self.waiter
        self.coordinator = build_coordinator(
            self.policy, self.zero, self.units, self.gatherer, self.group, self.waiter,
            HookedModules(*self._hooked_modules()), {n: named[n] for n in self.layout.param_names},
            on_negotiate=self._reduce_for_negotiation, before_done_rounds=self._launch_before_rounds)
        self.access = self.coordinator.access  # installed by the coordinator ([Note: parameter access])

    def _reduce_for_negotiation(self) -> None:
        """Without independent channels a negotiated micro-batch reduces after its rounds (comm/buckets.py)."""
        self.reducer.hold = not self.group.independent_channels

    def _launch_before_rounds(self) -> None:
        """A stage-3 micro-batch is computed: launch its reductions still short of gradients (what
        this rank did not produce counts as zero) before it ends its fetch protocol
        (FetchCoordinator._launch_before_done says why). Where all collectives share one order
        (NCCL, [Note: channels]) they stay where they were, after it: no wait blocks there."""
        if self.group.independent_channels:
            self.reducer.launch_all()

    def _register_grad_hooks(self, named) -> None:
        self._used = dict.fromkeys(self.layout.param_names, 0.0)
        self._trained = {name: named[name] for name in self.layout.param_names}
        engine = weakref.ref(self)  # autograd holds the hooks from C++: no strong cycle through them
        for name in self.layout.param_names:
            unit = self.layout.slots[name].unit

            def hook(p: torch.Tensor, name=name, unit=unit) -> None:
                owner = engine()
                if owner is not None:
                    owner._grad_ready(name, unit, p)
            self._hooks.append(named[name].register_post_accumulate_grad_hook(hook))

    def _grad_ready(self, name: str, unit: int, p: torch.Tensor) -> None:
        self._used[name] = 1.0  # it has a gradient: used ([Note: unused parameters] in engine/flat_pieces.py)
        if not self.reducer.accepting:
            return  # stages 0-1 accumulating: autograd keeps the full gradient until the last micro-batch
        self.reducer.add_grad(name, p.grad)
        p.grad = None
        flat = self.units[unit]
        flat.grads_pending -= 1
        if flat.grads_pending == 0 and self.coordinator is not None:
            self.coordinator.on_grads_done(unit)

    def _build_activations(self) -> None:
        coordinator = self.coordinator if self.policy.reshard_after_use else None
        if coordinator is not None:
            units = self.units
            is_param = lambda ptr: units.unit_at(ptr) is not None  # noqa: E731
        else:
            arena_ptr = self.units.arena.untyped_storage().data_ptr()
            is_param = lambda ptr: ptr == arena_ptr  # noqa: E731
        self.activations = ActivationTracker(is_param, inner=coordinator)
        targets = checkpoint_targets(self.model, self.zero.activation_checkpointing)
        self._restore_forwards = apply_checkpointing(
            targets, self.zero.offload_activations, self.activations,
            enter=coordinator.enter_module if coordinator else None,
            exit=coordinator.exit_module if coordinator else None)

    @property
    def activation_peak_bytes(self) -> int:
        return self.activations.peak

    # --- one step --------------------------------------------------------------------------

    @with_worker_context
    def train_step(self, batch: Any) -> StepStats:
        """One optimizer step on this rank's share of the global batch (collective)."""
        t0 = time.perf_counter()
        k = self.zero.grad_accum_steps
        self.group.counter.reset()
        self.grad.zero_()
        self._used = dict.fromkeys(self._used, 0.0)
        if self.coordinator is not None:
            self.coordinator.begin_step()
        scale = self.scaler.scale if self.scaler else 1.0
        losses: List[torch.Tensor] = []
        failure: Optional[BaseException] = None
        done = 0
        try:
            micro = self._micro_batches(batch, k)
            for i, mb in enumerate(micro):
                self._micro_batch(i, mb, i == k - 1, scale, losses)
                done = i + 1
        except CollectiveError:
            raise  # the group is broken: the runtime rebuilds it
        except Exception as error:  # noqa: BLE001 - the step fails on every rank; see [Note: step outcome]
            failure = error
            self._abort(done, k)
        sumsq = loss_sum = None
        if failure is None:
            # Gradients were summed over ranks and micro-batches: average, and undo the loss scale.
            self.grad.mul_(1.0 / (self.world_size * k * scale))
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
        skipped = False
        if not math.isfinite(norm):
            if self.scaler is None and not math.isfinite(loss_value):
                raise StepError(f"step {self.step_count}: loss_fn returned a non-finite loss ({loss_value}) on "
                                f"worker {self.rank}, so the gradients are not finite and the step was not "
                                "applied. Check the batch and the model for inf/nan (log of 0, division by 0, "
                                "overflow) or lower the learning rate.")
            if self.scaler is None:
                raise StepError(f"step {self.step_count}: the gradient norm is not finite (this worker's loss "
                                f"was {loss_value}). Lower the learning rate, clip gradients (max_grad_norm) "
                                "or check the data for inf/nan.")
            skipped = True
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

    def _micro_batches(self, batch: Any, k: int) -> List[Any]:
        return split_batch(to_device(batch, self.device), k, "worker's share of the batch (grad_accum_steps)")

    def _micro_batch(self, index: int, mb: Any, last: bool, scale: float, losses: List[torch.Tensor]) -> None:
        reduce_now = self.policy.reduce_every_micro_batch or last
        self.reducer.begin_backward(accepting=reduce_now)
        for unit in self.units:
            unit.grads_pending = len(unit.spec.params)
        if self.coordinator is not None:
            self.coordinator.begin_micro_batch(index)
        self.activations.begin()
        with self.activations.hooks():
            loss = self.loss_fn(self.model, mb)
        self.activations.end_forward()
        self._check_loss(loss)
        losses.append(loss.detach())
        if self.coordinator is not None:
            self.coordinator.begin_backward()
        (loss.float() * scale if self.scaler else loss).backward()
        if self.coordinator is not None:
            self.coordinator.finish_backward()
        if reduce_now:
            if index > 0 and not self.policy.reduce_every_micro_batch:
                self._reduce_accumulated()
            self.reducer.finish()
        if self.coordinator is not None:
            self.coordinator.end_micro_batch()

    def _reduce_accumulated(self) -> None:
        """Stages 0-1, last micro-batch: a parameter used in an earlier micro-batch but not in
        this one holds its accumulated gradient still (its hook did not fire now): reduce it too."""
        for name, p in self._trained.items():
            if p.grad is not None:
                self._grad_ready(name, self.layout.slots[name].unit, p)

    def _abort(self, current: int, k: int) -> None:
        """This rank's code raised in micro-batch ``current``: take part in every collective its
        peers still expect of the step, computing nothing ([Note: step outcome] in errors.py)."""
        coordinator = self.coordinator
        for i in range(current, k):
            if coordinator is not None:
                if len(coordinator.records) <= i:
                    coordinator.begin_micro_batch(i)
                coordinator.abort_micro_batch()
            if self.policy.reduce_every_micro_batch or i == k - 1:
                if i > current:
                    self.reducer.begin_backward(accepting=True)
                self.reducer.finish()  # what this rank did not produce counts as zero
            if coordinator is not None:
                coordinator.end_micro_batch()

    def _status(self, sumsq: Optional[torch.Tensor], loss_sum: Optional[torch.Tensor]
                ) -> Tuple[List[int], float, float, List[str]]:
        """The step's status all-reduce ([Note: step status] in engine/step_status.py): (ranks whose step
        failed, global gradient norm, this rank's summed micro-batch losses, the parameters no
        rank produced a gradient for). ``sumsq`` and ``loss_sum`` are None when this rank's step
        failed."""
        W = self.world_size
        trace = self.coordinator.status() if self.coordinator is not None else (0.0, 0.0, 0.0)
        # Stage 0 ranks all hold the same full reduced gradient: count its norm once.
        counted = sumsq if self.policy.keeps_param_shard or self.rank == 0 else None
        vec = step_status.encode(W, self.rank, counted, loss_sum, trace, self.bucket_learning.arrivals(),
                                 self.device, used=list(self._used.values()))
        if W > 1:
            self.waiter.until_complete(self.group.all_reduce(vec, async_op=True, control=True))
        status = step_status.decode(vec.tolist(), W, num_params=len(self._used))
        failed = status.failed
        if self.coordinator is not None:
            self.coordinator.end_step(failed=bool(failed), any_exit=status.any_exit, agreed=status.agreed)
        self.bucket_learning.after_step(self.step_count + 1, status.extra, W,
                                        learn=not failed and not status.any_exit)
        return failed, status.norm, status.ranks[self.rank].loss, status.unused(list(self._used))

    def bucket_stats(self) -> Dict[str, Any]:
        """The gradient buckets of the last step (see BucketLearning.stats)."""
        return self.bucket_learning.stats()

    def _drop_grads(self) -> None:
        self.grad.zero_()
        for p in self.model.parameters():
            p.grad = None

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StepError(f"step {self.step_count}: loss_fn must return a scalar tensor (the mean loss over the "
                            f"batch), got {shape}; reduce it with .mean()")
        if not loss.requires_grad:
            raise StepError(f"step {self.step_count}: the loss does not require grad: loss_fn must compute it "
                            "from the model's output (did it run under torch.no_grad()?)")
        # A non-finite loss is not raised here: its gradients turn non-finite, every rank sees
        # the non-finite global norm, and all raise together (fp32/bf16) or skip the step (fp16).

    def _publish(self) -> None:
        """Make the updated master visible to compute: cast, and start the stage 1-2 gathers
        ([Note: deferred publish] in fetch/coordinator.py)."""
        fp32 = self.dtype == torch.float32
        self.flush()
        with torch.no_grad():
            if not self.policy.keeps_param_shard:
                if not fp32:
                    self.units.arena.copy_(self.master.as_tensor())
                return
            if not fp32:
                self.param_shard.copy_(self.master)
            if not self.policy.reshard_after_use:
                self.coordinator.publish()

    def flush(self) -> None:
        """Wait for every parameter gather still in flight (stages 1-2, [Note: deferred publish])."""
        if self.coordinator is not None:
            with torch.no_grad():
                self.coordinator.flush()

    def fetch_stats(self) -> Dict[str, Any]:
        """Stage 3's fetch counters of the last step (empty at stages 0-2)."""
        if self.coordinator is None or not self.policy.reshard_after_use:
            return {}
        return dict(self.coordinator.stats)

    # --- evaluation and inference: [Note: inference calls] in engine/inference.py -------------------

    @with_worker_context
    def evaluate(self, batch: Any, metric_fn: Optional[Callable] = None) -> Dict[str, float]:
        """``loss_fn`` (and ``metric_fn``) on this rank's rows, in eval mode without gradients:
        ``{"loss": float, **metrics}`` (collective; trains nothing)."""
        return self._inference(evaluation(self.loss_fn, metric_fn), batch)

    @with_worker_context
    def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(model, *args)`` in eval mode without gradients; its result with every tensor on the
        CPU. Tensors in ``args`` arrive on this rank's device (collective; trains nothing)."""
        return self._inference(fn, *args)

    def _inference(self, fn: Callable, *args: Any) -> Any:
        result, failure = None, None
        try:
            with inference_call(self.model, self.coordinator):
                result = to_cpu(fn(self.model, *to_device(args, self.device)))
        except CollectiveError:
            raise  # the group is broken: the runtime rebuilds it
        except Exception as error:  # noqa: BLE001 - every rank raises together, as a step does
            failure = error
        failed = failed_ranks(self.group, self.waiter, failure is not None, self.device)
        if failure is not None:
            raise failure
        if failed:
            raise PeerStepError(f"worker(s) {failed} raised an error in an evaluate/run call (their own error says "
                                "why); this worker's part of it was dropped", failed)
        return result

    # --- inspection and state --------------------------------------------------------------

    def master_piece(self, name: str) -> Tuple[int, int, torch.Tensor]:
        """(lo, hi, fp32 values) of parameter ``name``'s flat elements held by this rank."""
        slot = self.layout.slots[name]
        if not self.policy.keeps_param_shard:
            if self.rank != 0:
                return 0, 0, torch.empty(0)
            start = self.layout.units[slot.unit].full_offset + slot.offset
            return 0, slot.numel, self.master[start:start + slot.numel].detach().cpu().clone()
        piece, lo, hi = self.layout.param_shard_view(self.master, name, self.rank)
        return lo, hi, piece.detach().cpu().clone()

    def master_shard(self) -> torch.Tensor:
        """This rank's fp32 master in the layout's shard coordinates (all stages alike)."""
        if self.policy.keeps_param_shard:
            return self.master.cpu()
        return self._full_to_shard(self.master.as_tensor().detach())

    def _full_to_shard(self, full: torch.Tensor) -> torch.Tensor:
        """Stage 0 keeps full-size tensors; checkpoints hold every stage in shard coordinates."""
        out = torch.zeros(self.layout.shard_numel, dtype=torch.float32)
        for unit in self.layout.units:
            lo, hi = unit.rank_range(self.rank)
            out[unit.shard_offset:unit.shard_offset + hi - lo] = full[unit.full_offset + lo:unit.full_offset + hi].cpu()
        return out

    def export_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Flat fp32 tensors in this rank's shard coordinates, and per-rank scalars."""
        tensors, scalars = self.optimizer.export_state()
        if not self.policy.keeps_param_shard:
            tensors = {k: self._full_to_shard(v) for k, v in tensors.items()}
        tensors["master"] = self.master_shard()
        scalars["step"] = self.step_count
        scalars["scaler"] = self.scaler.state() if self.scaler else None
        scalars["rng"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        return tensors, scalars

    def state_layout(self) -> Tuple[FlatLayout, int]:
        """The (layout, rank) whose shard coordinates import_state expects: stage 0 wants everything."""
        if not self.policy.keeps_param_shard:
            return self.layout.with_world_size(1), 0
        return self.layout, self.rank

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load tensors given in ``state_layout()`` coordinates (collective for stages 1-2)."""
        if not self.policy.keeps_param_shard:
            single = self.layout.with_world_size(1)
            full = {}
            for key, flat in tensors.items():
                out = torch.zeros(self.layout.full_numel, dtype=torch.float32)
                for unit, one in zip(self.layout.units, single.units):
                    out[unit.full_offset:unit.full_offset + unit.numel] = flat[one.shard_offset:one.shard_offset + one.numel]
                full[key] = out
            tensors = full
        self.flush()
        with torch.no_grad():
            self.master.copy_(tensors["master"].to(self.master.device))
        self.optimizer.import_state({k: v for k, v in tensors.items() if k != "master"}, scalars)
        self.step_count = int(scalars.get("step", 0))
        if self.scaler is not None and scalars.get("scaler"):
            self.scaler.load(scalars["scaler"])
        if scalars.get("rng"):
            state = torch.frombuffer(bytearray(base64.b64decode(scalars["rng"])), dtype=torch.uint8)
            torch.set_rng_state(state.clone())
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
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.coordinator is not None:
            self.coordinator.remove()
        if self.access is not None:
            self.access.remove()
        self._restore_forwards()
        self._restore_precision()
        self.activations.inner = None


def _adopt_kept_arena(layout: FlatLayout, kept: Dict[str, Tuple[int, int, torch.Tensor]], rank: int,
                      device: torch.device) -> Optional[torch.Tensor]:
    """The fp32 arena in which a sharded build left this rank's slices, laid out as the local
    shard ([Note: sharded construction] in construct/sharded_init.py), as a 1D tensor with zero padding;
    None when the slices are not there (another dtype or device), and they are then copied."""
    held = [v for lo, hi, v in kept.values() if hi > lo]
    if not held or any(v.dtype != torch.float32 for v in held):
        return None
    storage = held[0].untyped_storage()
    if storage.device != device or storage.nbytes() != layout.shard_numel * torch.float32.itemsize:
        return None
    shard = torch.empty(0, dtype=torch.float32, device=device).set_(storage, 0, (layout.shard_numel,))
    with torch.no_grad():
        for unit in layout.units:  # the tail of each unit's slice is padding, never written
            lo, hi = unit.rank_range(rank)
            shard[unit.shard_offset + hi - lo:unit.shard_offset + unit.shard_numel].zero_()
    return shard
