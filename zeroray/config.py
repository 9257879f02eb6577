"""User-facing configuration: frozen, keyword-only dataclasses validated on construction.

Each component receives only its own config object (torchtitan style), never a global one.
Every invalid value raises ``ValueError`` naming the field and saying what is allowed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Tuple, Union

DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_BUCKET_BYTES = 16 * 2**20
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _fail(cls: str, name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{cls}.{name}={value!r} is invalid: {allowed}")


def _positive_int(cls: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(cls, name, value, "it must be an integer >= 1")


def _positive_number(cls: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        _fail(cls, name, value, "it must be a finite number > 0" + (" or None" if allow_none else ""))


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What is sharded and how the bulk tensors move.

    stage: 0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters, or "auto":
        the Trainer picks the cheapest stage that fits the memory each worker has, with a 20%
        margin, for the model, its first batch (rows per worker, sequence length), the
        accumulation and the offload, and logs why; it starts the workers when first given data
        ([Note: stage from the first batch] in runtime/auto_stage.py).
    memory_budget: with stage="auto", the bytes per worker training's tensors may take (model
        states, activations, buffers, logits), the budget the stage is chosen for. None (default):
        the GPU's memory read from the device, or on CPU workers Ray's free memory shared by them.
    dtype: compute dtype of parameters and gradients; the optimizer keeps an fp32 master shard.
    reduce_dtype: dtype gradients are reduced in (None: fp32).
    bucket_bytes: size of one coalescing bucket (C_B) for gradient reduction and gathers, or
        "auto". With fixed buckets (no timeout, not "auto") the gradients' first bucket holds at
        most 1 MiB and none more than an eighth of the model's gradients (at least 1 MiB), as
        DDP cuts them, so that reduction runs during backward ([Note: first bucket] in
        comm/bucket_plan.py). "auto": gradient buckets start at the default size and, between
        steps, move to the size of the largest run of gradients that arrive within the flush timeout of each other
        (each change logged on the "zeroray" logger); gathers keep the default size. It also bounds
        the buffers of one chunk of an optimizer that steps whole parameters ([Note: whole-parameter
        exchange] in zeroray/engine/param_exchange.py; with offload="disk": offload_chunk_bytes).
    bucket_timeout_ms: flush timeout of a gradient bucket (None: off, a bucket is launched when
        full and at the end of backward). A bucket is also launched when this long has passed
        since its first gradient arrived, as planned from the gradients' measured arrival in
        earlier steps, so that every worker cuts the same buckets. With bucket_bytes="auto",
        None means an eighth of the measured backward.
    prefetch_bytes: stage 3, bytes of upcoming modules' parameters gathered ahead of use (each
        unit counted once, however often the trace ahead uses it). None
        (default): sized from the model, the bytes of its largest unit (the grain of gathers,
        see zeroray/layout/arena.py), so that every unit can be gathered ahead of its use, but never
        less than one coalescing bucket (bucket_bytes): a smaller window saves less memory than
        one bucket buffer holds and costs collectives. A unit whose next use lies inside the
        window stays gathered (see reuse_distance), so a model smaller than the window is
        gathered once per step. A larger window (a whole block of a large model) gathers
        further ahead and holds the memory at the peak. Measurements in benchmarks/README.md.
    max_live_bytes: stage 3, bound on gathered parameter bytes held at once (excluding the
        module being computed, which must always be gathered). None (default): no bound of its
        own; the prefetch window and reuse_distance decide what stays gathered.
    reuse_distance: stage 3, a module whose parameters are needed again within this many
        module calls is kept gathered instead of refetched (as is one whose next use lies within
        the prefetch window: the prefetcher would fetch it again at once).
    prefetch: stage 3, turn the trace-based prefetch on or off (off: synchronous fetch).
    wrap: which modules form a unit, the parameters gathered together (stages 1-3): "auto"
        (each block of an nn.ModuleList/nn.Sequential and each class the model lists in
        ``_no_split_modules``, plus the root for the rest), "module" (every module that owns
        parameters), a tuple of nn.Module classes, or a callable (qualified_name, module) -> bool.
        See zeroray/layout/wrap.py.
    cast_buffers: with dtype bf16/fp16, which floating buffers take the compute dtype. None
        (default): as ``model.to(dtype)`` would, except rotary ``inv_freq``/``original_inv_freq``
        (kept fp32); True: every one; False: none (each keeps its own dtype). Under all three,
        normalisation layers with running statistics (BatchNorm, InstanceNorm with
        track_running_stats) and the modules a Hugging Face model keeps in fp32 keep their
        buffers in fp32 and compute in fp32. See [Note: mixed precision] in zeroray/engine/precision.py.
    broadcast_buffers: True (default, torch DDP's default): every worker starts each step, each
        ``evaluate`` call and each ``run`` call with rank 0's buffers (BatchNorm running
        statistics), one broadcast per call for a model with buffers. False: each worker keeps
        its own, updated by its own rows (DDP's ``broadcast_buffers=False``); checkpoints, and so
        restore, resize and recovery, hold rank 0's either way. See [Note: buffers follow DDP]
        in zeroray/engine/buffer_sync.py.
    offload: where the optimizer state lives between steps ([Note: disk offload] in
        zeroray/offload/stepper.py). None (default): in memory, beside the parameters. "disk": in
        files under ``offload_dir``, one per state tensor (Adam's exp_avg and exp_avg_sq) over this
        worker's shard, and in mixed precision (bf16, fp16) the fp32 master too ([Note: master on
        disk] in zeroray/offload/master.py); the optimizer steps a chunk of
        ``offload_chunk_bytes`` at a time, reading the next chunk's master and state and writing
        the last one's while the current one steps, and casts each updated chunk into the
        parameters, so memory holds a few chunks, never all of it. At stage 3 the parameter
        shard is in a file too, read ahead of the gathers along the fetch trace and written by
        the step, and with it the fp32 master in every dtype ([Note: parameter shard on disk] in
        zeroray/offload/shard.py). At stages 0-2 in fp32 the master is the parameters themselves
        and stays in memory; so do the gradient and the compute-dtype parameters (the arena).
        Any worker, any stage. "cpu" (the GPU workers' host-memory tier) is not built yet: it is
        refused.
    offload_dir: with offload="disk", the directory each worker makes its scratch folder in
        (unlinked as soon as its files are open, so nothing is left behind however the worker
        ends; their space is freed when the engine closes); None: the system's temporary
        directory. The files are scratch: checkpoints hold the optimizer state as without offload.
    offload_chunk_bytes: with offload="disk", the bytes of one chunk, summed over the files
        (Adam: 8 bytes per element, 12 with the master: mixed precision, stage 3); memory holds three
        chunks (one stepping, one being read, one being written): 48 MiB by default. Larger chunks cost memory; smaller ones more
        Python calls per step.
    """

    stage: Union[int, str] = 3
    dtype: str = "fp32"
    reduce_dtype: Optional[str] = None
    bucket_bytes: Union[int, str] = DEFAULT_BUCKET_BYTES
    bucket_timeout_ms: Optional[float] = None
    prefetch_bytes: Optional[int] = None
    max_live_bytes: Optional[int] = None
    reuse_distance: int = 2
    prefetch: bool = True
    grad_accum_steps: int = 1
    max_grad_norm: Optional[float] = None
    # fp16 dynamic loss scaling
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff_factor: float = 0.5
    loss_scale_growth_interval: int = 1000
    min_loss_scale: float = 1.0
    # ZeRO-R
    activation_checkpointing: Union[bool, Tuple[type, ...], Sequence[type]] = False
    offload_activations: bool = False
    sharded_init: bool = True
    collective_timeout_s: float = 300.0
    wrap: Any = "auto"
    cast_buffers: Optional[bool] = None
    broadcast_buffers: bool = True
    offload: Optional[str] = None
    offload_dir: Optional[str] = None
    offload_chunk_bytes: int = 16 * 2**20
    memory_budget: Optional[float] = None

    def __post_init__(self) -> None:
        c = "ZeroConfig"
        _positive_number(c, "memory_budget", self.memory_budget, allow_none=True)
        if self.memory_budget is not None and self.stage != "auto":
            _fail(c, "memory_budget", self.memory_budget, "it is the budget stage='auto' chooses a stage for: set "
                  "stage='auto', or leave memory_budget None")
        self._validate_offload()
        if self.stage != "auto" and (not isinstance(self.stage, int) or isinstance(self.stage, bool)
                                     or self.stage not in (0, 1, 2, 3)):
            _fail(c, "stage", self.stage, "choose 0 (plain data parallel), 1, 2, 3 or 'auto'")
        if self.dtype not in DTYPES:
            _fail(c, "dtype", self.dtype, f"choose one of {DTYPES}")
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES:
            _fail(c, "reduce_dtype", self.reduce_dtype, f"choose one of {DTYPES} or None (fp32)")
        if self.bucket_bytes != "auto":
            value = self.bucket_bytes
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(c, "bucket_bytes", value, "it must be a positive number of bytes (an int > 0) or 'auto'")
        _positive_number(c, "bucket_timeout_ms", self.bucket_timeout_ms, allow_none=True)
        for name in ("prefetch_bytes", "max_live_bytes"):
            value = getattr(self, name)
            if value is None:
                continue  # sized from the model when the engine is built
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(c, name, value, "it must be a positive number of bytes (an int > 0) or None (sized from the model)")
        for name in ("prefetch", "offload_activations", "sharded_init", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "it must be True or False")
        if self.cast_buffers is not None and not isinstance(self.cast_buffers, bool):
            _fail(c, "cast_buffers", self.cast_buffers, "it must be None (the automatic rule: buffers take the "
                  "compute dtype except rotary inv_freq), True (cast every buffer) or False (cast none)")
        if not isinstance(self.reuse_distance, int) or isinstance(self.reuse_distance, bool) or self.reuse_distance < 0:
            _fail(c, "reuse_distance", self.reuse_distance, "it must be an integer >= 0")
        _positive_int(c, "grad_accum_steps", self.grad_accum_steps)
        _positive_number(c, "max_grad_norm", self.max_grad_norm, allow_none=True)
        _positive_number(c, "initial_loss_scale", self.initial_loss_scale)
        _positive_number(c, "min_loss_scale", self.min_loss_scale)
        if not (isinstance(self.loss_scale_growth_factor, (int, float)) and math.isfinite(self.loss_scale_growth_factor)
                and self.loss_scale_growth_factor > 1):
            _fail(c, "loss_scale_growth_factor", self.loss_scale_growth_factor, "it must be > 1")
        if not (isinstance(self.loss_scale_backoff_factor, (int, float)) and 0 < self.loss_scale_backoff_factor < 1):
            _fail(c, "loss_scale_backoff_factor", self.loss_scale_backoff_factor, "it must be in (0, 1)")
        _positive_int(c, "loss_scale_growth_interval", self.loss_scale_growth_interval)
        ac = self.activation_checkpointing
        if not isinstance(ac, bool):
            types = tuple(ac) if isinstance(ac, (tuple, list)) else None
            if not types or not all(isinstance(t, type) for t in types):
                _fail(c, "activation_checkpointing", ac,
                      "use True (every block), False, or a tuple of nn.Module classes to checkpoint")
            object.__setattr__(self, "activation_checkpointing", types)
        _positive_number(c, "collective_timeout_s", self.collective_timeout_s)
        wrap = self.wrap
        if isinstance(wrap, list):
            wrap = tuple(wrap)
            object.__setattr__(self, "wrap", wrap)
        if isinstance(wrap, str):
            if wrap not in ("auto", "module"):
                _fail(c, "wrap", wrap, "use 'auto', 'module', a tuple of nn.Module classes, or a callable "
                                       "(qualified_name, module) -> bool")
        elif isinstance(wrap, tuple):
            if not wrap or not all(isinstance(t, type) for t in wrap):
                _fail(c, "wrap", wrap, "a tuple must hold nn.Module classes (e.g. (MyBlock,))")
        elif not callable(wrap):
            _fail(c, "wrap", wrap, "use 'auto', 'module', a tuple of nn.Module classes, or a callable "
                                   "(qualified_name, module) -> bool")

    def _validate_offload(self) -> None:
        c = "ZeroConfig"
        if self.offload == "cpu":
            _fail(c, "offload", self.offload,
                  "the host-memory tier for GPU workers is not built yet (on CPU workers the optimizer state "
                  "already lives in host memory, so it would change nothing); use offload='disk' to keep the "
                  "optimizer state in files, or None")
        if self.offload not in (None, "disk"):
            _fail(c, "offload", self.offload, "choose None (optimizer state in memory) or 'disk' (in files under "
                                             "offload_dir)")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)):
                _fail(c, "offload_dir", self.offload_dir, "it must be a directory path (str) or None")
            if self.offload is None:
                _fail(c, "offload_dir", self.offload_dir, "it is only used with offload='disk': set offload='disk' "
                                                         "or leave offload_dir None")
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))
        value = self.offload_chunk_bytes
        if not isinstance(value, int) or isinstance(value, bool) or value < 256:
            _fail(c, "offload_chunk_bytes", value, "it must be a number of bytes (an int >= 256)")

    @property
    def reduce_dtype_name(self) -> str:
        return self.reduce_dtype or "fp32"

    @property
    def base_bucket_bytes(self) -> int:
        """``bucket_bytes``, or with "auto" the default: where gradient buckets start, and the
        bound of coalesced gathers, which "auto" leaves alone (see [Note: bucket sizing] in comm/bucket_plan.py)."""
        return DEFAULT_BUCKET_BYTES if self.bucket_bytes == "auto" else self.bucket_bytes

    @property
    def buckets_planned(self) -> bool:
        """Whether gradient buckets are planned from measured steps (a flush timeout or "auto"),
        rather than fixed ([Note: bucket timeout] in comm/bucket_plan.py)."""
        return self.bucket_bytes == "auto" or self.bucket_timeout_ms is not None


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many workers and what each gets.

    min_workers: after a failure, training continues with as many workers as the cluster
        offers, down to this many (None: num_workers, i.e. wait for the full size); with
        in-memory snapshots, the survivors go on alone when no replacement can be placed
        ([Note: shrink in memory] in runtime/worker_group/reform.py).
    placement_group: a Ray placement group someone else made (a Ray Tune trial's) to place the
        workers in, instead of one of zeroray's own; worker r takes bundle
        ``placement_bundles[r]`` (None: bundle r), which must hold ``cpus_per_worker`` CPUs (and
        a GPU with use_gpu). zeroray never removes it, and ``placement_strategy`` does not apply
        ([Note: given placement group] in runtime/worker_group/placement.py). zeroray.tune sets both.
    """

    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    min_workers: Optional[int] = None
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 60.0
    threads_per_worker: Optional[int] = None
    # A live Ray handle, not configuration: left out of repr (checkpoint manifests record the repr).
    placement_group: Any = field(default=None, repr=False)
    placement_bundles: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        c = "ScalingConfig"
        _positive_int(c, "num_workers", self.num_workers)
        if not isinstance(self.use_gpu, bool):
            _fail(c, "use_gpu", self.use_gpu, "it must be True or False")
        _positive_number(c, "cpus_per_worker", self.cpus_per_worker)
        if self.min_workers is not None:
            _positive_int(c, "min_workers", self.min_workers)
            if self.min_workers > self.num_workers:
                _fail(c, "min_workers", self.min_workers, f"it must be <= num_workers ({self.num_workers})")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            _fail(c, "placement_strategy", self.placement_strategy, f"choose one of {PLACEMENT_STRATEGIES}")
        _positive_number(c, "placement_timeout_s", self.placement_timeout_s)
        if self.threads_per_worker is not None:
            _positive_int(c, "threads_per_worker", self.threads_per_worker)
        self._check_given_placement()

    def _check_given_placement(self) -> None:
        c, bundles = "ScalingConfig", self.placement_bundles
        if bundles is None:
            return
        if self.placement_group is None:
            _fail(c, "placement_bundles", bundles, "it names bundles of placement_group=, which is not given")
        if (not isinstance(bundles, (tuple, list)) or len(set(bundles)) != len(bundles)
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in bundles)):
            _fail(c, "placement_bundles", bundles, "it must be a tuple of distinct bundle indices >= 0")
        if len(bundles) != self.num_workers:
            _fail(c, "placement_bundles", bundles, f"it must name one bundle per worker (num_workers={self.num_workers})")
        object.__setattr__(self, "placement_bundles", tuple(bundles))


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """max_failures: worker failures survived during fit (restart from the last checkpoint, or
    from the newest in-memory snapshot when that is newer).

    snapshot_every: during fit, every that many steps each worker's model-state shard (what a
    checkpoint holds for its rank) is copied out of the worker into Ray's object store, owned by
    the driver, so it survives the worker's death; a recovery restores the newest complete
    snapshot instead of an older disk checkpoint, and only the steps since it are redone (at
    most one with ``snapshot_every=1``). None (the default): no snapshots. Cost: one more shard
    per worker, 1/N of the model states (fp32 master weights and optimizer state), held in the
    object store of the worker's node (its shared memory, not the worker's heap), plus while a
    new snapshot is being taken the one it replaces; the copy runs on the worker between its
    steps. See [Note: in-memory snapshots] in runtime/snapshot.py for when it is lost (the
    node's object store died with its node) and recovery falls back to the disk checkpoint.
    With snapshots, a failure keeps the surviving workers: only the lost ones are replaced, the
    collective group is re-formed at the same size and every worker loads the snapshot.

    spares: warm spare workers kept beside the group (0: none), each in a placement group of
    its own, released for a resize and started again after it (the resources of one more worker: ``cpus_per_worker`` CPUs, and a GPU with
    ``use_gpu``) and a process with torch loaded; a replacement takes a spare instead of
    starting a process, and a new spare starts in the background. Used with ``snapshot_every``.
    """

    max_failures: int = 0
    snapshot_every: Optional[int] = None
    spares: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_failures, int) or isinstance(self.max_failures, bool) or self.max_failures < 0:
            _fail("FailureConfig", "max_failures", self.max_failures, "it must be an integer >= 0")
        v = self.snapshot_every
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            _fail("FailureConfig", "snapshot_every", v,
                  "it must be an integer >= 1 (snapshot every that many steps), or None for no snapshots")
        if not isinstance(self.spares, int) or isinstance(self.spares, bool) or self.spares < 0:
            _fail("FailureConfig", "spares", self.spares, "it must be an integer >= 0 (warm spare workers)")
        if self.spares and self.snapshot_every is None:
            _fail("FailureConfig", "spares", self.spares,
                  "spares replace lost workers while a fit keeps in-memory snapshots: set snapshot_every too")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """path: directory, pyarrow.fs URI, or ``zeroray.checkpoint.StoragePath`` (a path on a storage of
    your own); every_steps: save cadence during fit; keep: how many to keep."""

    path: Optional[Any] = None
    every_steps: Optional[int] = None
    keep: int = 2

    def __post_init__(self) -> None:
        c = "CheckpointConfig"
        # A StoragePath is recognised by its fields: this module sits above the checkpoint package.
        is_storage_path = hasattr(self.path, "storage") and isinstance(getattr(self.path, "path", None), str)
        if self.path is not None and not is_storage_path and (not isinstance(self.path, str) or not self.path):
            _fail(c, "path", self.path, "it must be a non-empty path string (or a zeroray.checkpoint.StoragePath)")
        if self.every_steps is not None:
            _positive_int(c, "every_steps", self.every_steps)
            if self.path is None:
                _fail(c, "every_steps", self.every_steps, "set CheckpointConfig.path too, so there is somewhere to save")
        _positive_int(c, "keep", self.keep)


# --- optimizer specs -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _OptimizerSpec:
    lr: float = 1e-3

    def build(self, params: Any) -> Any:  # -> torch.optim.Optimizer
        raise NotImplementedError

    def _check_lr(self) -> None:
        if (not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool)
                or not math.isfinite(self.lr) or self.lr < 0):
            _fail(type(self).__name__, "lr", self.lr, "it must be a finite number >= 0")

    @property
    def state_floats_per_param(self) -> int:
        """fp32 values of optimizer state per parameter, excluding the master weight."""
        raise NotImplementedError


def _finite_nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_betas(cls: str, betas: Any) -> None:
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        _fail(cls, "betas", betas, "it must be two numbers in [0, 1)")


# The fused kernel updates the flat master in one pass with no temporaries. The default
# (single-tensor) kernel allocates several master-sized temporaries per step, which on CPU
# are fresh mmap'ed pages each time, several times slower on a large master (measured in
# benchmarks/README.md). Results differ from it by rounding only.
_ADAM_KERNEL = {"fused": True}


@dataclass(frozen=True, kw_only=True)
class Adam(_OptimizerSpec):
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self._check_lr()
        _check_betas(type(self).__name__, self.betas)
        _positive_number(type(self).__name__, "eps", self.eps)
        if not _finite_nonneg(self.weight_decay):
            _fail(type(self).__name__, "weight_decay", self.weight_decay, "it must be a finite number >= 0")

    def build(self, params: Any) -> Any:
        import torch

        return torch.optim.Adam(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                weight_decay=self.weight_decay, **_ADAM_KERNEL)

    @property
    def state_floats_per_param(self) -> int:
        return 2


@dataclass(frozen=True, kw_only=True)
class AdamW(Adam):
    weight_decay: float = 1e-2

    def build(self, params: Any) -> Any:
        import torch

        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, **_ADAM_KERNEL)


@dataclass(frozen=True, kw_only=True)
class SGD(_OptimizerSpec):
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        self._check_lr()
        c = type(self).__name__
        for name in ("momentum", "dampening", "weight_decay"):
            v = getattr(self, name)
            if not _finite_nonneg(v):
                _fail(c, name, v, "it must be a finite number >= 0")
        if not isinstance(self.nesterov, bool):
            _fail(c, "nesterov", self.nesterov, "it must be True or False")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            _fail(c, "nesterov", self.nesterov, "Nesterov momentum needs momentum > 0 and dampening = 0")

    def build(self, params: Any) -> Any:
        import torch

        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                               weight_decay=self.weight_decay, nesterov=self.nesterov, foreach=False)

    @property
    def state_floats_per_param(self) -> int:
        return 1 if self.momentum > 0 else 0


@dataclass(frozen=True)
class Elementwise:
    """A callable ``params -> torch.optim.Optimizer`` its user declares element-wise: each element's
    update reads only that element's parameter value, gradient and state (and per-parameter
    scalars such as a step count), never a parameter's shape, a norm over a tensor or another
    element. zeroray then steps it on flat pieces of the shard, the fast path its own specs and
    torch's element-wise classes take ([Note: optimizer paths] in zeroray/engine/optim_choice.py).
    Declaring an optimizer that is not element-wise trains another model: leave it undeclared
    and it sees every parameter with its real shape. Made by ``zr.elementwise(fn)``."""

    fn: Callable[[Any], Any]

    def __post_init__(self) -> None:
        if isinstance(self.fn, (_OptimizerSpec, Elementwise)):
            raise ValueError(f"elementwise({self.fn!r}): zeroray's own specs are element-wise already; pass them as they are")
        if isinstance(self.fn, type) or not callable(self.fn):
            raise ValueError(f"elementwise(fn={self.fn!r}) needs a callable params -> torch.optim.Optimizer, "
                             "such as `lambda params: torch.optim.Adam(params, lr=1e-3)`")

    def build(self, params: Any) -> Any:  # -> torch.optim.Optimizer
        return self.fn(params)


def elementwise(fn: Callable[[Any], Any]) -> Elementwise:
    """Declare the optimizer ``fn`` builds element-wise, so that it runs on flat shard pieces (see
    ``Elementwise``): for a user's own optimizer, or a subclass of a torch one, known to be so."""
    return Elementwise(fn)


OptimizerSpec = Union[_OptimizerSpec, Elementwise, Callable[[Any], Any]]


def known_elementwise(spec: Any) -> bool:
    """Whether ``spec`` is element-wise by what it is, before anything is built: zeroray's own
    specs and the ones a user declared (``elementwise``)."""
    return isinstance(spec, (_OptimizerSpec, Elementwise))


def validate_optimizer(spec: Any) -> None:
    """An optimizer spec is one of ours, a declared element-wise callable, or any callable params
    -> torch.optim.Optimizer."""
    if isinstance(spec, (_OptimizerSpec, Elementwise)):
        return
    if isinstance(spec, type):
        raise ValueError(
            f"optimizer={spec.__name__} is a class, not a spec: pass zr.AdamW(lr=...), or a callable "
            f"such as `lambda params: {spec.__name__}(params, lr=...)`")
    if not callable(spec):
        raise ValueError(
            f"optimizer={spec!r} is invalid: pass zr.AdamW(...), zr.Adam(...), zr.SGD(...) or a callable "
            "params -> torch.optim.Optimizer")



def optimizer_spec_class(name: str) -> Optional[type]:
    """zeroray's optimizer spec class called ``name`` (``"AdamW"``), None for any other name: a
    checkpoint records a spec by its class name and fields ([Note: optimizer record] in
    zeroray/engine/optim_record.py), and restore rebuilds only these classes from it."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, _OptimizerSpec) and cls is not _OptimizerSpec:
        return cls
    return None
