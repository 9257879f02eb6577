"""Measured model-state bytes of one engine, by category, next to the paper's estimate, and
the worker's resident memory broken down around them.

Counts the bytes of the tensors the engine holds (not the allocator's view), so the figures
are exact and comparable with zeroray.memory.model's formulas. See [Note: stage data flow] in
engine/storage.py for which tensors exist at which stage.

[Note: RSS breakdown]
Given the process's phase figures (memory/process.py), ``measure`` also cuts the worker's
peak RSS over its steps into what is known to be in it::

    baseline          RSS before the model existed: Python, torch, Ray, the collective group
    model_states      params + grads + optimizer, measured (= the estimate)
    gathered_window   stage 3: the most unit bytes gathered at once (last step)
    buckets           the gradient buckets' and the gather staging's pools
    activations       bytes saved for backward at the end of forward, the step's high point
    other             the rest: temporaries that are not saved activations (a parameter's
                      gradient before its hook moves it into a bucket, backward's intermediate
                      results), what was imported after the baseline (building a torch
                      optimizer imports torch._dynamo), thread stacks, and allocator slack

and apart from the step peak: ``construction_transient`` (construction's peak minus the RSS it
left behind), ``unit_pool_idle`` (stage 3 on CPU: the unit mappings kept for the next step's
gathers, [Note: unit pool] in memory/unit_pool.py) and ``slack_at_rest`` (RSS after the steps
minus the baseline, every live tensor, by a gc census, and that idle pool: what the allocator
holds that no tensor uses, plus later imports).
The window and the activations peak at nearly the same moment (the start of backward), so
their sum stands for the step's high point; ``other`` is what that leaves unexplained.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from zeroray.memory import model as memory


def _storages(tensors) -> Dict[int, int]:
    """Distinct storages among ``tensors``: data pointer -> bytes it holds. Views of one storage
    (the parameters of stages 0-2 in their arena, the fp32 master that *is* the parameter
    shard) count once; a freed stage-3 unit buffer (storage resized to 0) counts nothing."""
    out: Dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def measure(engine, process: Optional[Dict[str, Optional[int]]] = None) -> Dict[str, Any]:
    """Bytes of the storages the engine holds, by category; see the module docstring.

    params: full parameter buffers (stages 0-2: the arena; stage 3: unit buffers gathered at
        the time of the call, normally none between steps) and the local parameter shard.
    grads: the fp32 gradient (full at stage 0, the shard otherwise).
    optimizer: the fp32 master (when it is not the parameter tensor itself, i.e. in mixed
        precision) and the inner optimizer's state tensors.
    Call it after a step: the optimizer allocates its state on the first one.
    ``process``: ``ProcessMemory.report()`` of the worker the engine runs in; adds ``rss`` (the
    breakdown of [Note: RSS breakdown]) and ``peak_rss_bytes`` (the process's lifetime peak).
    """
    zero, layout = engine.zero, engine.layout
    units = engine.units
    engine.flush()  # the stage 1-2 gathers of the last step, still in flight ([Note: deferred publish])
    shard = engine.param_shard.tensors() if engine.param_shard is not None else []
    param_st = _storages([u.full for u in units] + [units.arena] + shard)
    grad_st = {k: v for k, v in _storages([engine.grad]).items() if k not in param_st}
    optim_st = {k: v for k, v in _storages(engine.master.tensors() + engine.optimizer.state_tensors()).items()
                if k not in param_st and k not in grad_st}
    stats = engine.fetch_stats()
    reduce_buffers = engine.reducer.buffer_bytes()
    # The staging buffers themselves (all back in the free pool between steps): the gatherer's
    # buffer_bytes() counts every allocation at the largest size, also the undersized ones dropped.
    gather_buffers = engine.gatherer.free_staging_bytes() if engine.gatherer else 0
    measured = {"params": sum(param_st.values()), "grads": sum(grad_st.values()),
                "optimizer": sum(optim_st.values())}
    exchange = {k: v for k, v in _storages(engine.optimizer.exchange_buffers()).items()
                if k not in param_st and k not in grad_st and k not in optim_st}
    paper = memory.model_state_bytes(layout.numel, engine.world_size, zero.stage, zero.dtype,
                                     _optimizer_for_estimate(engine))
    report = {"stage": zero.stage, "dtype": zero.dtype, "num_workers": engine.world_size,
            "measured": {**measured, "total": sum(measured.values())},
            "estimate": expected_model_state(engine),
            "paper": {"params": paper.params, "grads": paper.grads, "optimizer": paper.optimizer,
                      "total": paper.total},
            "gathered_params_peak": stats.get("peak_gathered_bytes", 0),
            "bucket_buffers": reduce_buffers + gather_buffers + sum(exchange.values()),
            "reduce_buffers": reduce_buffers, "gather_buffers": gather_buffers,
            "activations_peak": engine.activation_peak_bytes,
            "unit_pool_idle": units.pool.idle_bytes if units.pool is not None else 0,
            "num_params": layout.numel, "padded_numel": layout.full_numel,
            **_cuda_stats(engine.device)}
    if engine.optimizer.whole_params:
        report["whole_params"] = _whole_params(engine, sum(_storages(engine.optimizer.state_tensors()).values()),
                                               sum(exchange.values()))
    if process is not None:
        report["peak_rss_bytes"] = process["peak_rss_bytes"]
        report["rss"] = rss_breakdown(report, process)
    return report


def rss_breakdown(report: Dict[str, Any], process: Dict[str, Optional[int]]) -> Dict[str, Optional[int]]:
    """[Note: RSS breakdown] from a ``measure`` report and ``ProcessMemory.report()``; a figure
    the platform cannot give is None, and so is anything computed from it."""
    base, peak = process["baseline_rss"], process["step_peak_rss"]
    parts = {"model_states": report["measured"]["total"], "gathered_window": report["gathered_params_peak"],
             "buckets": report["bucket_buffers"], "activations": report["activations_peak"]}
    known = None if base is None else base + sum(parts.values())
    built, after = process["construction_peak_rss"], process["after_construction_rss"]
    rest = process["rss"]
    return {"baseline": base, **parts,
            "other": None if peak is None or known is None else peak - known,
            "step_peak": peak,
            "construction_peak": built,
            "construction_transient": None if built is None or after is None else built - after,
            "rss_at_rest": rest,
            "unit_pool_idle": report["unit_pool_idle"],
            "slack_at_rest": None if rest is None or base is None else (
                rest - base - live_tensor_bytes(False) - report["unit_pool_idle"]),
            "peak_rss": process["peak_rss_bytes"]}


def _cuda_stats(device) -> Dict[str, Any]:
    """On GPU the allocator knows the peaks (activations included); on CPU there is no such statistic."""
    if device.type != "cuda":
        return {}
    return {"cuda_allocated": torch.cuda.memory_allocated(device),
            "cuda_max_allocated": torch.cuda.max_memory_allocated(device),
            "cuda_reserved": torch.cuda.memory_reserved(device)}


def _whole_params(engine, state_bytes: int, exchange_bytes: int) -> Dict[str, Any]:
    """The whole-parameter optimizer's share of this rank (engine/shaped_optim.py's ``share``:
    what it steps, against the balanced share, and the owner map's imbalance over all ranks),
    with the state it holds in memory and its exchange buffers."""
    share = engine.optimizer.share()
    held = share["held_numel"]
    return {**share, "state_bytes": state_bytes, "state_bytes_per_element": state_bytes / held if held else 0.0,
            "exchange_buffers": exchange_bytes, "state_on_disk": engine.optimizer.offload_stats().get("state_bytes", 0)}


def _optimizer_for_estimate(engine) -> Any:
    """The optimizer as zeroray.memory.model understands it: our specs say their state size; for a
    custom callable, the fp32 state values per element are read off what it allocated (the
    whole-parameter path: none here, ``expected_model_state`` adds its state apart)."""
    try:
        memory.optimizer_state_bytes_per_param(engine.optimizer_spec, engine.zero.dtype)
        return engine.optimizer_spec
    except ValueError:
        if engine.optimizer.whole_params:
            return 0
        disk = engine.optimizer.disk
        if disk is not None:  # offload="disk": the state is in the files, one per value per element
            return len(disk.keys)
        state = sum(_storages(engine.optimizer.state_tensors()).values())
        return state // max(4 * engine.master.numel(), 1)


def expected_model_state(engine) -> Dict[str, int]:
    """zeroray.memory.model's formulas for this engine's configuration: the paper's per-stage model
    (see [Note: model states] in memory/model.py) on the engine's padded layout, with zeroray's
    documented deviations from the paper ([Note: stage data flow] in engine/storage.py):

    - padding: every unit is padded to a multiple of the world size (layout/arena.py), so the
      replicated terms count ``layout.full_numel`` and the sharded ones ``full_numel / W``;
    - the reduced gradient is fp32 in every dtype (``grad_dtype="fp32"``): it is the fp32
      master's gradient, where the paper keeps a 16-bit gradient;
    - stage 1 reduce-scatters gradients out of the buckets as backward produces them, as stage 2
      does, so it holds the gradient *shard*, not the paper's full gradient (with
      ``grad_accum_steps > 1`` autograd holds full local gradients between micro-batches).
    - ``offload="disk"``: the optimizer state, and in mixed precision the fp32 master, are in
      files; the optimizer term is the three chunks of every file the disk tier holds in memory
      (the measured term adds the 0-dim scalars, Adam's ``step``, a few bytes per flat piece).
    - an optimizer stepping whole parameters (engine/shaped_optim.py): its state per element is
      this rank's measured one, on a balanced share of the elements (the owner map's imbalance
      is the difference: ``measure``'s "whole_params").
    Stages 1-2 hold no parameter shard of their own: the all-gather source, and in fp32 the
    master, is the rank's rows of the parameter arena ([Note: local shard] in layout/local_shard.py),
    so their parameter term is the paper's. (Until that change they kept a separate shard in
    the compute dtype, P·Φ/W more, which this estimate used to add.)

    Nothing here looks at the engine's tensors, only at its layout and configuration (except
    the state size of a custom optimizer callable, which only its allocation tells).
    """
    zero, layout, W = engine.zero, engine.layout, engine.world_size
    padded = layout.full_numel
    optimizer = _optimizer_for_estimate(engine)

    # offload="disk": the optimizer term is the disk tier's buffers ([Note: disk offload])
    chunk = zero.offload_chunk_bytes if zero.offload == "disk" else None
    held = memory.held_state_bytes(padded, W, zero.stage, zero.dtype, optimizer, padded_numel=padded,
                                   offload_chunk_bytes=chunk)
    optimizer_term = held.optimizer
    if engine.optimizer.whole_params and chunk is None:
        # The state's size per element is this rank's, measured (Adafactor's factored state is
        # less than one value per element); the estimate is that on a balanced share, so the
        # measured figure shows the owner map's imbalance ([Note: parameter owners]).
        share = _whole_params(engine, sum(_storages(engine.optimizer.state_tensors()).values()), 0)
        optimizer_term += round(share["state_bytes_per_element"] * share["balanced_numel"])
    return {"params": held.params, "grads": held.grads, "optimizer": optimizer_term,
            "total": held.params + held.grads + optimizer_term}


def live_tensor_bytes(floating_only: bool = True) -> int:
    """Bytes of every distinct tensor storage alive in this process, found by a gc census.

    Independent of :func:`measure`: it does not ask the engine what it holds, so a copy the
    engine's attributes do not show (a unit buffer left gathered, a leaked gradient) shows up
    here. Meta tensors and empty storages count nothing.
    """
    import gc

    gc.collect()
    seen: Dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance reads __class__, which wakes deprecated proxies.
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
                continue
            if floating_only and not obj.is_floating_point():
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError, ReferenceError):
            continue
        if storage.nbytes() and storage.data_ptr():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())
