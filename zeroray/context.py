"""``zeroray.worker_context()``: which worker the user's code is running on.

The user's functions run on every worker alike: ``loss_fn`` in a step, ``loss_fn`` and
``metric_fn`` in ``trainer.evaluate``, ``fn`` in ``trainer.run``. Code that must differ per
worker (log on rank 0 only, give each rank its own prompt) asks ``zeroray.worker_context()``
for its rank and the world size, as ``ray.train.get_context()`` does in Ray Train. The engine
sets it around each of those calls (``with_worker_context``) on the thread that runs them; a
``contextvars.ContextVar`` holds it, so it is right on whichever thread an engine call lands
and nothing is left set between calls. Outside them it raises: there is no worker to describe.
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar


@dataclass(frozen=True)
class WorkerContext:
    """The worker running the current call: ``rank`` in ``range(world_size)``."""

    rank: int
    world_size: int


_CURRENT: contextvars.ContextVar[Optional[WorkerContext]] = contextvars.ContextVar("zeroray_worker", default=None)


def worker_context() -> WorkerContext:
    """The rank and world size of the worker running this code, inside ``loss_fn``, ``metric_fn``
    and ``trainer.run``'s ``fn``; a RuntimeError anywhere else."""
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("zeroray.worker_context() is only known while a worker runs your code: inside loss_fn "
                           "(trainer.step, fit, evaluate), metric_fn (evaluate) or fn (trainer.run)")
    return context


F = TypeVar("F", bound=Callable[..., Any])


def with_worker_context(method: F) -> F:
    """An engine method during which ``worker_context()`` describes the engine's rank (its
    ``rank`` and ``world_size`` attributes)."""
    @functools.wraps(method)
    def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
        token = _CURRENT.set(WorkerContext(engine.rank, engine.world_size))
        try:
            return method(engine, *args, **kwargs)
        finally:
            _CURRENT.reset(token)
    return call  # type: ignore[return-value]
