"""``zt.trainable(train, scaling)``: a zeroray training function as a Ray Tune trainable, with the
trial's resources.

[Note: trial placement]
A Tune trial reserves its resources as one placement group, made from the trainable's
``PlacementGroupFactory`` before the trial starts and removed when it stops; the trainable's
actor runs in its first bundle. zeroray asks for ``[{"CPU": driver_cpus}] + [worker bundle] *
num_workers`` (``trial_resources``): the first bundle is the trial's driver (the function, which
drives the Trainer as a script's main thread would; Ray Train gives its trainer 1 CPU too, and
``driver_cpus=0`` leaves it without a reservation), each further bundle one worker (its
``cpus_per_worker`` CPUs, and a GPU with ``use_gpu``). Inside the trial, ``zt.Trial`` reads the
placement group back (``ray.util.get_current_placement_group()``: Tune starts the trainable with
``placement_group_capture_child_tasks``) and builds the Trainer with
``ScalingConfig(placement_group=pg, placement_bundles=...)``, so each worker actor goes into its
bundle and nothing is placed outside the trial ([Note: given placement group] in
runtime/worker_group/placement.py). The worker count is read from the trial's bundles, not from the config:
a trial whose resources Tune changed (``ResourceChangingScheduler``) or that was given another
trial's checkpoint (PBT's exploit) restores it at its own count. Without this, a Trainer made
inside a trial would make a placement group of its own next to the trial's: resources Tune
never counted, which on a full cluster never come, so the trial would wait forever.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional, Union

from ray import tune

from zeroray.config import ScalingConfig
from zeroray.runtime.code_shipping import ship_by_value
from zeroray.tune.trial import Trial

ScalingSpec = Union[ScalingConfig, Callable[[dict], ScalingConfig]]


def trial_resources(scaling: ScalingConfig, driver_cpus: float = 1.0) -> tune.PlacementGroupFactory:
    """The resources of one trial: a bundle for the trial's driver, then one per worker, placed with
    the scaling's strategy ([Note: trial placement])."""
    if not isinstance(scaling, ScalingConfig):
        raise ValueError(f"scaling must be a zr.ScalingConfig, got {type(scaling).__name__}")
    if scaling.placement_group is not None:
        raise ValueError("ScalingConfig(placement_group=...) is set inside a trial, from the trial's own placement "
                         "group; give zeroray.tune a ScalingConfig without it")
    if isinstance(driver_cpus, bool) or not isinstance(driver_cpus, (int, float)) or driver_cpus < 0:
        raise ValueError(f"driver_cpus={driver_cpus!r} must be a number >= 0 (CPUs reserved for the trial's driver)")
    worker = {"CPU": float(scaling.cpus_per_worker)}
    if scaling.use_gpu:
        worker["GPU"] = 1.0
    return tune.PlacementGroupFactory([{"CPU": float(driver_cpus)}] + [dict(worker) for _ in range(scaling.num_workers)],
                                      strategy=scaling.placement_strategy)


def trainable(train: Callable[[dict, Trial], Any], scaling: ScalingSpec, *, driver_cpus: float = 1.0,
              staging: Optional[str] = None) -> Any:
    """``train(config, trial)`` as a Tune trainable (for ``tune.Tuner``) whose trials reserve
    ``trial_resources(scaling)``.

    ``scaling``: a ``zr.ScalingConfig``, or a function ``config -> zr.ScalingConfig`` (trials of
    different sizes); ``num_workers``, ``cpus_per_worker`` and ``use_gpu`` become the trial's
    bundles, and its other fields (``threads_per_worker``, ``placement_timeout_s``, ...) reach
    the Trainer. ``train`` gets the trial's ``config`` and a ``zt.Trial``; every Trainer made by
    ``trial.trainer`` is shut down when ``train`` returns or raises, and when Tune stops the
    trial (ASHA, PBT's pause, the end of the run). ``staging``: where checkpoints are written
    before Tune copies them into its storage (see staging.py; default: a temporary directory on
    the trial's node, which every worker must be able to write).
    """
    if not callable(train):
        raise ValueError(f"train must be a function (config, trial), got {type(train).__name__}")
    if staging is not None and "://" not in str(staging):
        staging = os.path.abspath(staging)  # a trial runs in a directory of Tune's: relative to here
    try:
        params = [p for p in inspect.signature(train).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        params = None
    if params is not None and len(params) != 2:
        raise ValueError(f"train must take two arguments, (config, trial): {getattr(train, '__name__', train)} takes "
                         f"{[p.name for p in params]}")
    template = scaling if callable(scaling) and not isinstance(scaling, ScalingConfig) else None
    if template is None:
        resources: Any = trial_resources(scaling, driver_cpus)  # checks scaling and driver_cpus now
    else:
        def resources(config: dict) -> tune.PlacementGroupFactory:
            return trial_resources(template(config), driver_cpus)

    def run(config: dict) -> None:
        trial = Trial(template(config) if template is not None else scaling, staging=staging)
        try:
            train(config, trial)
        finally:
            trial.close()  # also when Tune stops the trial: its report raises SystemExit in this thread

    # The trial's name in Tune. Not __qualname__: cloudpickle would look that name up in this module.
    run.__name__ = getattr(train, "__name__", "zeroray_trial")
    run.__doc__ = getattr(train, "__doc__", None)
    ship_by_value(train, scaling)  # the user's modules travel with it ([Note: shipping model code])
    return tune.with_resources(run, resources)
