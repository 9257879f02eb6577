"""The per-rank training engine: one rank's model, shards, reducer, coordinator and optimizer.

No Ray here: the engine is plain PyTorch over a ``Group`` and is tested for exact parity in
torch processes. The Ray worker actor (runtime/worker.py) only wraps it.

[Note: stage data flow]
Tensors per rank (Φ trainable elements, W workers, "shard" = ``layout.shard_numel``):

stage | full params (compute dtype)     | local param shard      | fp32 grad    | fp32 master + optimizer
0     | persistent arena                | -                      | full         | full
1, 2  | persistent arena                | shard (gather source)  | shard        | shard
3     | per unit, gathered on demand    | shard                  | shard        | shard

In fp32 the master is the parameter tensor itself (the local shard for stages 1-3, the
arena for stage 0): no copy. Gradients leave autograd through a post-accumulate hook and
go straight into the coalescing buckets (comm/buckets.py), which all-reduce (stage 0) or
reduce-scatter (stages 1-3) them into the fp32 gradient. Stages 0 and 1 with gradient
accumulation let autograd accumulate full gradients locally and reduce once, on the last
micro-batch; stages 2 and 3 reduce-scatter every micro-batch into the fp32 shard, so the
accumulated gradient only ever exists as the owner's shard.
"""
from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zeroray.activations import ActivationTracker, apply_checkpointing, checkpoint_targets
from zeroray.arena import FlatLayout
from zeroray.comm.buckets import GradBuckets, default_unit_order
from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Group
from zeroray.config import ZeroConfig, validate_optimizer
from zeroray.fetch import FetchCoordinator
from zeroray.optim import LossScaler, ShardedOptimizer, build_segments
from zeroray.params import UnitBuffers
from zeroray.sharded_init import build_sharded

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepError(RuntimeError):
    """A user-visible problem in one step (bad loss value, non-finite gradients)."""


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    step: int
    skipped: bool
    loss_scale: Optional[float]
    time_s: float


def split_batch(batch: Any, parts: int, what: str = "batch") -> List[Any]:
    """Split a tensor / tuple / list / dict of tensors along dim 0 into ``parts`` equal pieces."""
    size = batch_size(batch)
    if size % parts:
        raise ValueError(f"the {what} has {size} rows, which does not split evenly into {parts} parts: "
                         f"use a batch size divisible by {parts}")
    n = size // parts
    return [_slice(batch, i * n, (i + 1) * n) for i in range(parts)]


def batch_size(batch: Any) -> int:
    leaves = _leaves(batch)
    if not leaves:
        raise ValueError("the batch holds no tensors: pass a tensor, or a tuple/list/dict of tensors")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"every tensor of the batch needs the same dim 0 (the batch), got sizes {sorted(map(str, sizes))}")
    return sizes.pop()


def batch_structure(batch: Any) -> Any:
    """Structure and per-row shapes/dtypes: to detect batches that change shape between steps."""
    if isinstance(batch, torch.Tensor):
        return ("T", tuple(batch.shape[1:]), str(batch.dtype))
    if isinstance(batch, dict):
        return ("D", tuple((k, batch_structure(v)) for k, v in sorted(batch.items())))
    if isinstance(batch, (list, tuple)):
        return ("L", tuple(batch_structure(v) for v in batch))
    return ("O", type(batch).__name__)


def structure_changed(step: int, before: Any, after: Any) -> str:
    """The message for a batch whose structure differs from the first step's."""
    return (f"step {step}: the batch structure changed from {describe_structure(before)} to "
            f"{describe_structure(after)} (N = rows, which may vary); every step must get batches of the same "
            "structure, row shapes and dtypes: pad or crop them to one shape, or build a new Trainer for the new one")


def describe_structure(structure: Any) -> str:
    """batch_structure() in words, e.g. ``(tensor[N, 5] int64, tensor[N, 5] int64)``."""
    kind, rest = structure[0], structure[1:]
    if kind == "T":
        shape, dtype = rest
        return f"tensor[{', '.join(['N'] + [str(d) for d in shape])}] {dtype.replace('torch.', '')}"
    if kind == "D":
        return "{" + ", ".join(f"{k!r}: {describe_structure(v)}" for k, v in rest[0]) + "}"
    if kind == "L":
        return "(" + ", ".join(describe_structure(v) for v in rest[0]) + ")"
    return str(rest[0])


def _leaves(batch: Any) -> List[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _leaves(v)]
    return []


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, dict):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, lo, hi) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class Engine:
    def __init__(self, model_fn: Callable[[], torch.nn.Module], loss_fn: Callable, optimizer: Any,
                 zero: ZeroConfig, group: Group, *, seed: int = 0, device: Any = "cpu",
                 param_groups: Optional[Callable[[str, torch.nn.Parameter], dict]] = None,
                 scheduler: Optional[Callable[[Any], Any]] = None) -> None:
        validate_optimizer(optimizer)
        self.zero, self.group, self.loss_fn, self.optimizer_spec = zero, group, loss_fn, optimizer
        self.rank, self.world_size = group.rank, group.world_size
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[zero.dtype]
        self.reduce_dtype = TORCH_DTYPES[zero.reduce_dtype_name]
        self.step_count = 0
        self._structure = None

        built = None
        if zero.stage == 3 and zero.sharded_init:
            built = build_sharded(model_fn, seed, self.world_size, self.rank)
        if built is not None:
            model, self.layout, kept = built
        else:
            torch.manual_seed(seed)
            model, kept = model_fn(), None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
        self.model = model.to(self.device)
        if built is None:
            self.layout = FlatLayout.from_module(self.model, self.world_size)
        if not self.layout.units:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False): "
                             "there is nothing to train")
        if self.dtype != torch.float32:
            self._cast_untrained(self.dtype)
        named = dict(self.model.named_parameters())
        self._build_storage(named, kept)
        self._build_optimizer(optimizer, named, param_groups, scheduler)
        self._build_reducer()
        self.coordinator: Optional[FetchCoordinator] = None
        if zero.stage == 3:
            self._build_coordinator()
        self._register_grad_hooks(named)
        self._pending_publish: Dict[int, Any] = {}  # unit -> gather handle still in flight
        self._publish_hooks = self._register_publish_hooks() if zero.stage in (1, 2) else []
        self._build_activations()
        self.scaler = (LossScaler(zero.initial_loss_scale, zero.loss_scale_growth_factor,
                                  zero.loss_scale_backoff_factor, zero.loss_scale_growth_interval,
                                  zero.min_loss_scale) if zero.dtype == "fp16" else None)

    # --- construction ----------------------------------------------------------------------

    def _cast_untrained(self, dtype: torch.dtype) -> None:
        """Frozen parameters and floating buffers compute in the low precision too."""
        with torch.no_grad():
            for p in self.model.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)
            for mod in self.model.modules():
                for k, b in mod._buffers.items():
                    if b is not None and b.is_floating_point():
                        mod._buffers[k] = b.to(dtype)

    def _build_storage(self, named: Dict[str, torch.nn.Parameter],
                       kept: Optional[Dict[str, Tuple[int, int, torch.Tensor]]] = None) -> None:
        layout, stage = self.layout, self.zero.stage
        fp32 = self.dtype == torch.float32
        # The fp32 initial values of the rank's shard, taken before the parameters are rebound.
        init_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)  # 1D
        for name in layout.param_names:
            piece, lo, hi = layout.param_shard_view(init_shard, name, self.rank)
            if hi > lo:
                # pop: each kept slice is freed once copied, so construction never holds two shards
                values = kept.pop(name)[2] if kept is not None else named[name].detach().reshape(-1)[lo:hi]
                piece.copy_(values.float())
        self.buffers = UnitBuffers(layout, self.dtype, self.device, persistent=stage < 3)
        self.buffers.bind(named, copy_values=kept is None)
        if stage == 0:
            self.param_shard = None
            self.master = self.buffers.arena if fp32 else self.buffers.arena.float()  # 1D full
            self.grad = torch.zeros(layout.full_numel, dtype=torch.float32, device=self.device)  # 1D full
        else:
            self.master = init_shard                                                     # 1D shard fp32
            self.param_shard = self.master if fp32 else init_shard.to(self.dtype)         # 1D shard
            self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)  # 1D shard
        self.gatherer = UnitGatherer(layout, self.group, self.param_shard, self.zero.bucket_bytes) \
            if self.param_shard is not None else None

    def _local_spans(self, named, param_groups) -> List[Tuple[int, int, dict]]:
        """(start, end, overrides) of each parameter's piece in the master tensor, in order."""
        spans = []
        for name in self.layout.param_names:
            overrides = dict(param_groups(name, named[name]) or {}) if param_groups else {}
            if "params" in overrides:
                raise ValueError(f"param_groups({name!r}) returned a 'params' key: return only the "
                                 "overrides (lr, weight_decay, ...) for that parameter")
            slot = self.layout.slots[name]
            unit = self.layout.units[slot.unit]
            if self.zero.stage == 0:
                start = unit.full_offset + slot.offset
                spans.append((start, start + slot.numel, overrides))
            else:
                u_lo, u_hi = unit.rank_range(self.rank)
                lo, hi = max(u_lo, slot.offset), min(u_hi, slot.offset + slot.numel)
                if hi > lo:
                    start = unit.shard_offset + lo - u_lo
                    spans.append((start, start + hi - lo, overrides))
        return spans

    def _build_optimizer(self, spec, named, param_groups, scheduler) -> None:
        segments = build_segments(self._local_spans(named, param_groups), self.master.numel())
        self.optimizer = ShardedOptimizer(spec, self.master, self.grad, segments,
                                          self.group if self.zero.stage > 0 else None,
                                          self.zero.max_grad_norm, scheduler)

    def _build_reducer(self, unit_order=None) -> None:
        order = default_unit_order(self.layout, unit_order)
        self.reducer = GradBuckets(
            self.layout, self.group, self.grad,
            mode="all_reduce" if self.zero.stage == 0 else "reduce_scatter",
            bucket_bytes=self.zero.bucket_bytes, dtype=self.reduce_dtype, unit_order=order)

    def _modules_with_units(self) -> Tuple[List[torch.nn.Module], List[str], List[Tuple[int, ...]]]:
        """Each module object that uses units (once, under its first name) and those units."""
        modules, names, units = [], [], []
        by_name = dict(self.model.named_modules(remove_duplicate=False))
        index_of: Dict[int, int] = {}
        for mname, unit_ids in self.layout.module_units.items():
            module = by_name[mname]
            if id(module) in index_of:  # one module object registered under two names
                i = index_of[id(module)]
                units[i] = tuple(sorted(set(units[i]) | set(unit_ids)))
                continue
            index_of[id(module)] = len(modules)
            modules.append(module)
            names.append(mname)
            units.append(tuple(unit_ids))
        return modules, names, units

    def _build_coordinator(self) -> None:
        modules, names, units = self._modules_with_units()
        z = self.zero
        self.coordinator = FetchCoordinator(
            self.buffers, self.gatherer, self.group, modules, names, units, prefetch=z.prefetch,
            prefetch_bytes=z.prefetch_bytes, max_live_bytes=z.max_live_bytes, reuse_distance=z.reuse_distance)

    def _build_activations(self) -> None:
        if self.coordinator is not None:
            coordinator = self.coordinator
            is_param = lambda ptr: ptr in coordinator._ptr_to_unit
            before_run = lambda m: coordinator.backward and coordinator.ensure_module(m)
        else:
            arena_ptr = self.buffers.arena.untyped_storage().data_ptr()
            is_param = lambda ptr: ptr == arena_ptr
            before_run = None
        self.activations = ActivationTracker(is_param, inner=self.coordinator)
        targets = checkpoint_targets(self.model, self.zero.activation_checkpointing)
        apply_checkpointing(targets, self.zero.offload_activations, self.activations, before_run)

    @property
    def activation_peak_bytes(self) -> int:
        return self.activations.peak

    def _register_grad_hooks(self, named) -> None:
        self._reduce_now = True
        self._unit_pending: List[int] = []
        self._unit_params = [len(u.params) for u in self.layout.units]
        for name in self.layout.param_names:
            named[name].register_post_accumulate_grad_hook(self._make_grad_hook(name))

    def _make_grad_hook(self, name: str):
        unit = self.layout.slots[name].unit

        def hook(p: torch.Tensor) -> None:
            if not self._reduce_now:
                return
            self.reducer.add_grad(name, p.grad)
            p.grad = None
            if self.coordinator is not None:
                self._unit_pending[unit] -= 1
                if self._unit_pending[unit] == 0:
                    self.coordinator.on_grads_done(unit)
        return hook

    # --- one step --------------------------------------------------------------------------

    def train_step(self, batch: Any) -> StepStats:
        t0 = time.perf_counter()
        structure = batch_structure(batch)
        if self._structure is not None and structure != self._structure:
            raise ValueError(structure_changed(self.step_count, self._structure, structure))
        self._structure = structure
        k = self.zero.grad_accum_steps
        micro = split_batch(to_device(batch, self.device), k, "worker's share of the batch (grad_accum_steps)")
        self.group.counter.reset()
        self.grad.zero_()
        if self.coordinator is not None:
            self.coordinator.begin_step()
        scale = self.scaler.scale if self.scaler else 1.0
        losses = []
        for i, mb in enumerate(micro):
            last = i == k - 1
            self._reduce_now = self.zero.stage >= 2 or last
            self._unit_pending = list(self._unit_params)
            self.activations.begin()
            with self.activations.hooks():
                loss = self.loss_fn(self.model, mb)
            self.flush_params()  # units no module ran this forward
            self.activations.end_forward()
            self._check_loss(loss)
            losses.append(float(loss.detach().float()))
            if self.coordinator is not None:
                self.coordinator.begin_backward()
            (loss.float() * scale if self.scaler else loss).backward()
            if self._reduce_now:
                self.reducer.finish()
            if self.coordinator is not None:
                self.coordinator.end_micro_batch(last)
        # Gradients were summed over ranks and micro-batches: average, and undo the loss scale.
        self.grad.mul_(1.0 / (self.world_size * k * scale))
        norm = self.optimizer.grad_norm()
        loss_value = sum(losses) / k
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
            self.optimizer.step(norm)
            self._publish_params(defer=True)
        self.step_count += 1
        return StepStats(loss_value, norm, self.step_count, skipped,
                         self.scaler.scale if self.scaler else None, time.perf_counter() - t0)

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StepError(f"step {self.step_count}: loss_fn must return a scalar tensor (the mean loss over the "
                            f"batch), got {shape}; reduce it with .mean()")
        if not loss.requires_grad:
            raise StepError(f"step {self.step_count}: the loss does not require grad: loss_fn must compute it "
                            "from the model's output (did it run under torch.no_grad()?)")
        # A non-finite loss is not raised here: other ranks may already be in backward, waiting
        # in a collective. Its gradients turn non-finite, every rank sees the non-finite global
        # norm, and all raise together (fp32/bf16) or skip the step together (fp16).

    def _publish_params(self, defer: bool = False) -> None:
        """Make the updated master visible to compute: cast, and gather for stages 1-2.

        [Note: deferred publish]
        With ``defer`` the stage 1-2 all-gathers of the updated parameters are only launched
        here; the next forward waits for each unit's gather in the pre-hook of the first
        module that uses it, so the gathers run while the driver sends the next batch and
        while the earlier modules compute (the paper's overlap, as stage 3's prefetch does).
        Only forward reads the full parameters; ``flush_params`` finishes whatever forward
        did not wait for, and every other path that reads or rewrites them calls it first.
        """
        stage, fp32 = self.zero.stage, self.dtype == torch.float32
        self.flush_params()
        with torch.no_grad():
            if stage == 0:
                if not fp32:
                    self.buffers.arena.copy_(self.master)
                return
            if not fp32:
                self.param_shard.copy_(self.master)
            if stage in (1, 2):
                units = [u.index for u in self.layout.units]
                for g in self.gatherer.coalesce(units):
                    handle = self.gatherer.gather(g, [self.buffers.full[u] for u in g], async_op=True)
                    for u in g:
                        self._pending_publish[u] = handle
                if not defer:
                    self.flush_params()

    def flush_params(self) -> None:
        """Wait for every parameter gather still in flight (stages 1-2, [Note: deferred publish])."""
        while self._pending_publish:
            _, handle = self._pending_publish.popitem()
            with torch.no_grad():
                handle.wait()

    def _register_publish_hooks(self) -> list:
        modules, _, module_units = self._modules_with_units()
        pending = self._pending_publish

        def make_hook(units):
            def hook(module, args):
                if pending:
                    for u in units:
                        handle = pending.pop(u, None)
                        if handle is not None:
                            with torch.no_grad():
                                handle.wait()
            return hook
        return [m.register_forward_pre_hook(make_hook(units)) for m, units in zip(modules, module_units)]

    # --- inspection and state --------------------------------------------------------------

    def master_piece(self, name: str) -> Tuple[int, int, torch.Tensor]:
        """(lo, hi, fp32 values) of parameter ``name``'s flat elements held by this rank."""
        slot = self.layout.slots[name]
        if self.zero.stage == 0:
            if self.rank != 0:
                return 0, 0, torch.empty(0)
            start = self.layout.units[slot.unit].full_offset + slot.offset
            return 0, slot.numel, self.master[start:start + slot.numel].detach().cpu().clone()
        piece, lo, hi = self.layout.param_shard_view(self.master, name, self.rank)
        return lo, hi, piece.detach().cpu().clone()

    def master_shard(self) -> torch.Tensor:
        """This rank's fp32 master in the layout's shard coordinates (all stages alike)."""
        if self.zero.stage > 0:
            return self.master.detach().cpu().clone()
        return self._full_to_shard(self.master.detach())

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
        if self.zero.stage == 0:
            tensors = {k: self._full_to_shard(v) for k, v in tensors.items()}
        tensors["master"] = self.master_shard()
        scalars["step"] = self.step_count
        scalars["scaler"] = self.scaler.state() if self.scaler else None
        scalars["rng"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        return tensors, scalars

    def state_layout(self) -> Tuple[FlatLayout, int]:
        """The (layout, rank) whose shard coordinates import_state expects: stage 0 wants everything."""
        if self.zero.stage == 0:
            return self.layout.with_world_size(1), 0
        return self.layout, self.rank

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load tensors given in ``state_layout()`` coordinates (collective for stages 1-2)."""
        if self.zero.stage == 0:
            single = self.layout.with_world_size(1)
            full = {}
            for key, flat in tensors.items():
                out = torch.zeros(self.layout.full_numel, dtype=torch.float32)
                for unit, one in zip(self.layout.units, single.units):
                    out[unit.full_offset:unit.full_offset + unit.numel] = flat[one.shard_offset:one.shard_offset + one.numel]
                full[key] = out
            tensors = full
        with torch.no_grad():
            self.master.copy_(tensors["master"].to(self.master.device))
        self.optimizer.import_state({k: v for k, v in tensors.items() if k != "master"}, scalars)
        self.step_count = int(scalars.get("step", 0))
        if self.scaler is not None and scalars.get("scaler"):
            self.scaler.load(scalars["scaler"])
        if scalars.get("rng"):
            state = torch.frombuffer(bytearray(base64.b64decode(scalars["rng"])), dtype=torch.uint8)
            torch.set_rng_state(state.clone())
        self._publish_params()

    def untrained_state(self) -> Dict[str, torch.Tensor]:
        """Frozen parameters and buffers (replicated), under their state_dict names."""
        trained = set(self.layout.slots)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k not in trained}

    def close(self) -> None:
        self.flush_params()
        for h in self._publish_hooks:
            h.remove()
        if self.coordinator is not None:
            self.coordinator.remove()
