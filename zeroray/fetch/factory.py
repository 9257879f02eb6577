"""Choosing the coordinator of a stage: the one place that knows which exists for which stage.

Stage 3 fetches and frees every unit around its use (``FetchCoordinator``, fetch/coordinator.py);
stages 1-2 only publish the optimizer's update (``PublishCoordinator``, fetch/publish.py); stage 0
holds every parameter and has none. Both coordinators offer the methods of ``Coordinator``, so
the engine drives either one the same way.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.config import ZeroConfig
from zeroray.fetch.access import ParameterAccess
from zeroray.fetch.coordinator import FetchCoordinator
from zeroray.fetch.hooks import HookedModules
from zeroray.fetch.publish import PublishCoordinator
from zeroray.fetch.unit import Units
from zeroray.layout.stage import StagePolicy


class Coordinator(Protocol):
    """What the engine calls on a coordinator, in the order of a step (and of an inference call)."""

    records: List
    stats: dict
    access: ParameterAccess

    def begin_step(self) -> None: ...
    def begin_micro_batch(self, micro_batch: int) -> None: ...
    def begin_backward(self) -> None: ...
    def finish_backward(self) -> None: ...
    def abort_micro_batch(self) -> None: ...
    def end_micro_batch(self) -> None: ...
    def status(self) -> Tuple[float, float, float]: ...
    def end_step(self, failed: bool, any_exit: bool, agreed: bool) -> None: ...
    def publish(self) -> None: ...
    def flush(self) -> None: ...
    def begin_inference(self) -> None: ...
    def end_inference(self) -> None: ...
    def on_access(self, name: str, unit: int) -> None: ...
    def on_grads_done(self, unit: int) -> None: ...
    def enter_module(self, module: torch.nn.Module) -> bool: ...
    def exit_module(self, module: torch.nn.Module) -> None: ...
    def pack(self, t: torch.Tensor): ...
    def unpack(self, obj): ...
    def remove(self) -> None: ...


def build_coordinator(policy: StagePolicy, zero: ZeroConfig, units: Units, gatherer: UnitGatherer, group: Group,
                      waiter: Waiter, hooked: HookedModules, params: Dict[str, torch.nn.Parameter], *,
                      on_negotiate: Callable[[], None] = lambda: None,
                      before_done_rounds: Callable[[], None] = lambda: None
                      ) -> Optional[Union[FetchCoordinator, PublishCoordinator]]:
    """The coordinator of ``policy``'s stage (None at stage 0), hooked into ``hooked`` and seeing
    the reads of ``params`` (the trainable parameters). ``on_negotiate`` and
    ``before_done_rounds`` are stage 3's (FetchCoordinator says when each is called)."""
    if policy.reshard_after_use:
        return FetchCoordinator(units, gatherer, group, waiter, hooked, params, prefetch=zero.prefetch,
                                prefetch_bytes=zero.prefetch_bytes, max_live_bytes=zero.max_live_bytes,
                                reuse_distance=zero.reuse_distance, on_negotiate=on_negotiate,
                                before_done_rounds=before_done_rounds)
    if policy.keeps_param_shard:
        return PublishCoordinator(units, gatherer, waiter, hooked, params)
    return None
