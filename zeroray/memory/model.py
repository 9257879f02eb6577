"""The paper's memory model: bytes of model states and activations per worker.

Pure arithmetic, used by ``zr.estimate_memory``, the ``zeroray estimate`` command and the
runtime's ``memory_report`` (measured vs. estimated). Nothing here touches
torch.distributed or ray; torch is imported only inside :func:`count_params`.

[Note: model states]
For Φ parameters, Nd workers, P bytes per parameter, G bytes per gradient and K bytes of
optimizer state per parameter (ZeRO paper §3, Figure 1), bytes per worker are::

    stage 0 (plain DP)        P·Φ      + G·Φ      + K·Φ
    stage 1 (P_os)            P·Φ      + G·Φ      + K·Φ/Nd
    stage 2 (P_os+g)          P·Φ      + G·Φ/Nd   + K·Φ/Nd
    stage 3 (P_os+g+p)        P·Φ/Nd   + G·Φ/Nd   + K·Φ/Nd

Mixed precision (fp16/bf16): P = G = 2 and K = 4 (fp32 master weight) + 4·(state floats),
so K = 12 for Adam. fp32: P = G = 4 and K = 4·(state floats), so K = 8 for Adam: the
parameters themselves are the master copy. A sharded term holds ``ceil(Φ/Nd)`` elements per
worker (a worker holds whole elements), or ``padded_numel/Nd`` when the caller knows the
engine's padded layout (layout/arena.py pads every unit to a multiple of Nd).

All sizes are bytes; "GB" in this project's reports means 1e9 bytes, as in the paper.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# fp32 values of optimizer state per parameter, not counting a master weight.
OPTIMIZER_STATE_FLOATS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}
STAGES = (0, 1, 2, 3)

OptimizerLike = Union[str, int, Any]


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states held by one worker, by category."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


# --- argument checks ---------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_count(name: str, value: Any, minimum: int) -> int:
    """A whole count given as an int or a float such as 7.5e9; rounded to the nearest int."""
    if not _is_number(value) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be a number >= {minimum}")
    return int(round(value))


def _check_workers(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
    return value


def _check_stage(stage: Any) -> int:
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r} is invalid: choose 0 (plain data parallel), 1 (optimizer "
                         "state sharded), 2 (+ gradients) or 3 (+ parameters)")
    return stage


def _dtype_bytes(name: str, dtype: Any) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name}={dtype!r} is invalid: choose one of {tuple(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _state_floats(optimizer: OptimizerLike) -> int:
    # zr.Adam / zr.SGD specs say how much state they keep; accepting them lets the runtime
    # pass its optimizer spec straight through.
    floats = getattr(optimizer, "state_floats_per_param", None)
    if isinstance(floats, int) and not isinstance(floats, bool) and floats >= 0:
        return floats
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATE_FLOATS:
        return OPTIMIZER_STATE_FLOATS[optimizer.lower()]
    raise ValueError(f"optimizer={optimizer!r} is invalid: choose one of {tuple(OPTIMIZER_STATE_FLOATS)}, "
                     "or give the number of fp32 state values per parameter as an int >= 0")


# --- model states ------------------------------------------------------------------------------


def optimizer_state_bytes_per_param(optimizer: OptimizerLike, dtype: str) -> int:
    """K of the paper: bytes of optimizer state per parameter (Adam: 12 mixed, 8 in fp32)."""
    master = 0 if _dtype_bytes("dtype", dtype) == 4 else 4  # fp32 params are their own master
    return master + 4 * _state_floats(optimizer)


def model_state_bytes(num_params: Union[int, float], num_workers: int, stage: int,
                      dtype: str = "fp16", optimizer: OptimizerLike = "adam",
                      grad_dtype: Optional[str] = None,
                      padded_numel: Optional[int] = None) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state on one worker; see [Note: model states].

    grad_dtype: the gradient's dtype when it differs from ``dtype`` (e.g. "fp32" when the
        engine keeps an fp32 gradient shard in mixed precision).
    padded_numel: the engine's padded element count (a multiple of ``num_workers``); the
        sharded terms then count ``padded_numel / num_workers`` elements per worker, while the
        replicated terms still count ``num_params``.
    """
    numel = _check_count("num_params", num_params, 0)
    num_workers = _check_workers("num_workers", num_workers)
    stage = _check_stage(stage)
    p_bytes = _dtype_bytes("dtype", dtype)
    g_bytes = p_bytes if grad_dtype is None else _dtype_bytes("grad_dtype", grad_dtype)
    k_bytes = optimizer_state_bytes_per_param(optimizer, dtype)
    if padded_numel is None:
        shard = -(-numel // num_workers)
    else:
        if (not isinstance(padded_numel, int) or isinstance(padded_numel, bool)
                or padded_numel < numel or padded_numel % num_workers):
            raise ValueError(f"padded_numel={padded_numel!r} is invalid: it must be an int >= num_params "
                             f"({numel}) and a multiple of num_workers ({num_workers}), or None")
        shard = padded_numel // num_workers
    return ModelStateBytes(
        params=p_bytes * (shard if stage >= 3 else numel),
        grads=g_bytes * (shard if stage >= 2 else numel),
        optimizer=k_bytes * (shard if stage >= 1 else numel),
    )


def held_state_bytes(num_params: Union[int, float], num_workers: int, stage: int, dtype: str = "fp16",
                     optimizer: OptimizerLike = "adam", padded_numel: Optional[int] = None,
                     offload_chunk_bytes: Optional[int] = None) -> ModelStateBytes:
    """The model states zeroray's engine holds, where it departs from the paper's formula
    ([Note: stage data flow] in engine/storage.py): the reduced gradient is fp32 in every dtype
    (the fp32 master's gradient; the paper keeps a 16-bit one), and stage 1 reduce-scatters out
    of the buckets as stage 2 does, so it holds the gradient shard, not the full gradient. The
    memory report and the planner's footprint both count this.

    ``offload_chunk_bytes``: with ``offload="disk"`` (its ``offload_chunk_bytes``), the optimizer
    term is what stays in memory, the disk tier's buffers (:func:`offload_buffer_bytes`): the
    per-element state and, in mixed precision, the fp32 master live in files ([Note: disk
    offload] in offload/stepper.py). In fp32 the master is the parameters, counted under params,
    except at stage 3, where the parameter shard is in a file too, and so the master, in every
    dtype: the parameter term is then 0 ([Note: parameter shard on disk] in offload/shard.py)."""
    def states(s: int) -> ModelStateBytes:
        return model_state_bytes(num_params, num_workers, s, dtype, optimizer, grad_dtype="fp32",
                                 padded_numel=padded_numel)

    held = states(stage)
    optimizer_term = held.optimizer
    if offload_chunk_bytes is not None:
        optimizer_term = offloaded_optimizer_bytes(held, dtype, optimizer, offload_chunk_bytes, stage)
    params = 0 if offload_chunk_bytes is not None and stage == 3 else held.params
    return ModelStateBytes(params, states(2).grads if stage == 1 else held.grads, optimizer_term)


OFFLOAD_SLOTS = 3  # the disk tier's chunks in memory: one stepping, one being read, one being written
OFFLOAD_ALIGN = 64  # elements: a multiple of every CPU vector width (AVX-512 fp32: 16), unrolled 4x


def offload_chunk_elements(chunk_bytes: int, num_files: int, numel: int) -> int:
    """Elements per chunk of the disk tier ([Note: disk offload] in offload/stepper.py) over
    ``numel`` elements in ``num_files`` fp32 files, so that one slot (a chunk of each file) holds
    ``chunk_bytes``, a multiple of ``OFFLOAD_ALIGN``: vectorised kernels (fused AdamW on the CPU)
    run whole vectors and then a scalar tail, whose arithmetic may differ in the last bit; with
    chunks of whole vectors every element takes the same path as in one step of the whole piece,
    so the result is bitwise the same. Never more than ``numel`` (at least 1)."""
    per_file = chunk_bytes // (4 * max(1, num_files))
    return max(1, min(max(OFFLOAD_ALIGN, per_file // OFFLOAD_ALIGN * OFFLOAD_ALIGN), numel or 1))


def offload_files(dtype: str, optimizer: OptimizerLike, stage: int = 0) -> int:
    """The disk tier's files per worker that the optimizer step reads: one per fp32 state value
    per element, and the fp32 master in mixed precision (in fp32 the master is the parameters
    themselves, in memory) and at stage 3 (the parameter shard is on disk, and the master with
    it). The stage-3 parameter shard's own file is read by the gathers, not in chunks."""
    master = _dtype_bytes("dtype", dtype) != 4 or _check_stage(stage) == 3
    return _state_floats(optimizer) + (1 if master else 0)


def offload_buffer_bytes(shard_numel: int, dtype: str, optimizer: OptimizerLike, chunk_bytes: int,
                         stage: int = 0) -> int:
    """Bytes of the disk tier's buffers in a worker's memory: ``OFFLOAD_SLOTS`` chunks of every
    file (none when there are no files: plain SGD in fp32 at stages 0-2)."""
    files = offload_files(dtype, optimizer, stage)
    if not files:
        return 0
    return OFFLOAD_SLOTS * files * 4 * offload_chunk_elements(chunk_bytes, files, shard_numel)


def offloaded_optimizer_bytes(held: ModelStateBytes, dtype: str, optimizer: OptimizerLike, chunk_bytes: int,
                              stage: int = 0) -> int:
    """The optimizer term with ``offload="disk"``: the disk tier's buffers over the shard whose
    model states in memory are ``held`` (:func:`offload_buffer_bytes`; the shard's elements
    from its optimizer term, or at stage 3 from its parameter term, which a stateless
    optimizer leaves the only one)."""
    if stage == 3:
        shard = held.params // _dtype_bytes("dtype", dtype)
    else:
        shard = held.optimizer // max(optimizer_state_bytes_per_param(optimizer, dtype), 1)
    return offload_buffer_bytes(shard, dtype, optimizer, chunk_bytes, stage)


def estimate_memory(num_params: Union[int, float], num_workers: int, stage: int,
                    dtype: str = "fp16", optimizer: OptimizerLike = "adam",
                    grad_dtype: Optional[str] = None, snapshot: bool = False,
                    offload: Optional[str] = None, offload_chunk_bytes: int = 16 * 2**20) -> int:
    """Total bytes of model states per worker (paper Figure 1: 7.5e9 params, 64 workers,
    fp16, Adam -> 120e9, 31.4e9, 16.6e9, 1.9e9 bytes for stages 0-3). ``snapshot``: plus one
    in-memory snapshot per worker (``FailureConfig(snapshot_every)``, :func:`snapshot_bytes`).
    ``offload="disk"``: the optimizer term (K: the state and, in mixed precision, the fp32
    master) is in files; memory holds the disk tier's buffers, :func:`offload_buffer_bytes` of
    ``offload_chunk_bytes`` chunks, instead; at stage 3 the parameter shard (P·Φ/W) is in a
    file too, and the master with it in fp32 ([Note: parameter shard on disk] in offload/shard.py).
    ``offload="cpu"``: the host-memory tier of GPU workers, which the engine does not have yet
    (``ZeroConfig`` refuses it), on paper: the same layout in host memory instead of files, so the
    device holds what the disk tier leaves in memory."""
    if offload not in (None, "disk", "cpu"):
        raise ValueError(f"offload={offload!r} is invalid: choose None (the optimizer state in memory), 'disk' "
                         "or 'cpu' (host memory, on paper)")
    held = model_state_bytes(num_params, num_workers, stage, dtype, optimizer, grad_dtype)
    total = held.total
    if offload is not None:
        total += offloaded_optimizer_bytes(held, dtype, optimizer, offload_chunk_bytes, stage) - held.optimizer
        if stage == 3:
            total -= held.params
    return total + (snapshot_bytes(num_params, num_workers, optimizer) if snapshot else 0)


def snapshot_bytes(num_params: Union[int, float], num_workers: int, optimizer: OptimizerLike = "adam",
                   padded_numel: Optional[int] = None) -> int:
    """Bytes of one worker's in-memory snapshot (``FailureConfig(snapshot_every)``): what a
    checkpoint holds for its rank, the fp32 master and the optimizer state of its shard, at
    every stage and dtype (stage 0 exports its shard of the replicated state): 4 + 4·(state
    floats) bytes per element of the shard, 1/Nd of the model states' fp32 copy. It lives in
    Ray's object store (the node's shared memory), not in the worker's heap. ``padded_numel``
    as in :func:`model_state_bytes`."""
    numel = _check_count("num_params", num_params, 0)
    num_workers = _check_workers("num_workers", num_workers)
    shard = -(-numel // num_workers) if padded_numel is None else padded_numel // num_workers
    return (4 + 4 * _state_floats(optimizer)) * shard


def max_params_that_fit(memory_bytes: Union[int, float], num_workers: int, stage: int,
                        dtype: str = "fp16", optimizer: OptimizerLike = "adam",
                        grad_dtype: Optional[str] = None, offload: Optional[str] = None) -> int:
    """The largest Φ whose model states fit in ``memory_bytes`` per worker (activations and
    buffers not included), i.e. the inverse of :func:`estimate_memory`."""
    if not _is_number(memory_bytes) or memory_bytes < 0:
        raise ValueError(f"memory_bytes={memory_bytes!r} is invalid: it must be a number of bytes >= 0")
    budget = int(memory_bytes)

    def fits(n: int) -> bool:
        return estimate_memory(n, num_workers, stage, dtype, optimizer, grad_dtype, offload=offload) <= budget

    fits(0)  # validates the other arguments before searching
    # Bytes grow monotonically with Φ but by ceil(Φ/Nd) steps, so search instead of dividing.
    hi = 1
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo), or lo == 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- activations (ZeRO-R P_a) ------------------------------------------------------------------


def activation_bytes(*, layers: int, hidden: int, seq_len: int, batch: int,
                     heads: Optional[int] = None, dtype: str = "fp16", checkpointing: bool = False,
                     partitioned_over: int = 1, offload: bool = False) -> int:
    """Residual activation bytes of a transformer on one worker, for its micro-batch ``batch``.

    Per layer, with s = seq_len, b = batch, h = hidden, a = heads (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", eq. 1)::

        full(layer) = s·b·h·(34 + 5·a·s/h)   bytes with 16-bit activations

    The 5·a·s/h term is the s×s attention scores, softmax and dropout mask; with
    ``heads=None`` it is left out, as for fused (flash) attention that never stores the
    scores. For fp32 the whole count is doubled (1-byte dropout masks are not singled out).

    - no checkpointing: ``layers · full(layer)``.
    - ``checkpointing``: only each layer's input survives the forward (s·b·h elements per
      layer), plus one layer's full activations while it is recomputed in backward.
    - ``partitioned_over=N``: each worker keeps 1/N of every checkpoint (the paper's P_a);
      without checkpointing there is nothing to partition and N has no effect.
    - ``offload``: the checkpoints live in host memory, so the device holds only the working
      set of the layer being recomputed.
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("seq_len", seq_len), ("batch", batch)):
        _check_workers(name, value)
    if heads is not None:
        _check_workers("heads", heads)
    elem = _dtype_bytes("dtype", dtype)
    partitioned_over = _check_workers("partitioned_over", partitioned_over)
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing={checkpointing!r} is invalid: it must be True or False")
    if not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r} is invalid: it must be True or False")
    if offload and not checkpointing:
        raise ValueError("offload=True moves activation checkpoints to host memory: it needs "
                         "checkpointing=True")
    sbh = seq_len * batch * hidden
    attention = 5 * heads * seq_len * seq_len * batch if heads is not None else 0  # = sbh·5as/h
    per_layer = (34 * sbh + attention) * elem // 2
    if not checkpointing:
        return layers * per_layer
    if offload:
        return per_layer
    checkpoint = -(-sbh * elem // partitioned_over)
    return layers * checkpoint + per_layer


# --- counting a model --------------------------------------------------------------------------


def count_params(model_or_spec: Any, *, trainable_only: bool = False) -> int:
    """Unique parameters of a model (tied weights counted once).

    ``model_or_spec`` is an ``nn.Module``, a zero-argument callable returning one, or a
    ``"module:function"`` string naming such a callable (or a module-level ``nn.Module``).
    Models built from a callable are built on the meta device when possible, so counting
    a large model allocates no memory.
    """
    import torch

    model = model_or_spec
    if isinstance(model_or_spec, str):
        model = _resolve_spec(model_or_spec)
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise ValueError(f"model={model_or_spec!r} is invalid: pass an nn.Module, a callable "
                             "returning one, or a 'module:function' string")
        model = _build(model, model_or_spec)
    unique = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in unique.values())


def _resolve_spec(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model={spec!r} is invalid: write it as 'module:function', e.g. "
                         "'mypkg.models:build_model'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model={spec!r}: cannot import module {module_name!r} ({e}); check the "
                         "name and that its directory is on PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _build(fn: Any, spec: Any) -> Any:
    import torch

    try:
        # Meta tensors carry shapes but no storage: a 7.5B model is counted for free.
        with torch.device("meta"):
            model = fn()
    except Exception:
        # Some constructors read real data (e.g. torch.frombuffer); build them for real.
        try:
            model = fn()
        except Exception as e:
            raise ValueError(f"model={spec!r}: building the model failed with {type(e).__name__}: {e}; "
                             "it must be a zero-argument function that builds the model") from e
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={spec!r} returned {type(model).__name__}, not an nn.Module: it must "
                         "be a zero-argument function that builds the model")
    return model
