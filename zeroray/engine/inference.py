"""Running the sharded model without training it: evaluation and arbitrary inference calls.

[Note: inference calls]
``Engine.evaluate`` (``loss_fn`` and ``metric_fn`` on this rank's rows) and ``Engine.run``
(any ``fn(model, *args)``, e.g. Hugging Face ``generate``) share one context,
``inference_call``: the model in ``eval()`` mode (dropout off, BatchNorm on its running
statistics) under ``torch.no_grad()``, its previous mode restored after. Nothing of training
is touched: no gradient, no optimizer state, no step count, no random numbers beyond what
the user's code draws, and stage 3's trace is not re-recorded (the next step follows the same
schedule as if the call had not happened).

How each stage provides the parameters during the call (its coordinator's ``begin_inference``;
fetch/build.py says which coordinator a stage has): stage 0 holds them; stages 1-2 wait for the
gathers that published the last update (PERSISTENT mode); stage 3 negotiates every fetch
([Note: negotiated fetch] in fetch/negotiate.py) under a call id of its own. Negotiation, not a
trace, because an inference call's ranks need not run the same modules the same number of
times: ``generate`` stops at a different length on each rank, a rank may have nothing to do.
A rank that has finished (or raised) keeps answering its peers' rounds until every rank is
done, so no rank waits on one that left; DeepSpeed's ZeRO-3 ``generate`` instead hangs there
unless every rank is told to keep stepping (``synced_gpus``), its issue #8262. Negotiation
costs one small all-gather per fetch and no prefetch: fine for evaluation and sampling, which
are not the hot loop.

Every call then ends in one small all-reduce of who failed (like the step's status,
[Note: step outcome] in errors.py): every rank returns, or every rank raises (the failing one
its own error, the others ``PeerStepError``), so the driver sees one outcome and the group
stays in step.
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from zeroray.comm.group import Group
from zeroray.comm.waiter import Waiter
from zeroray.engine.batch import to_device
from zeroray.errors import CollectiveError, PeerStepError
from zeroray.fetch.lifecycle import Coordinator


def run_call(model: torch.nn.Module, coordinator: Coordinator, group: Group, waiter: Waiter, device: torch.device,
             fn: Callable, *args: Any) -> Any:
    """``fn(model, *args)`` in an inference call, its result on the CPU; every rank returns, or
    every rank raises ([Note: inference calls]). Collective."""
    result, failure = None, None
    try:
        with inference_call(model, coordinator):
            result = to_cpu(fn(model, *to_device(args, device)))
    except CollectiveError:
        raise  # the group is broken: the runtime rebuilds it
    except Exception as error:  # noqa: BLE001 - every rank raises together, as a step does
        failure = error
    failed = failed_ranks(group, waiter, failure is not None, device)
    if failure is not None:
        raise failure
    if failed:
        raise PeerStepError(f"worker(s) {failed} raised an error in an evaluate/run call (their own error says "
                            "why); this worker's part of it was dropped", failed)
    return result


@contextlib.contextmanager
def inference_call(model: torch.nn.Module, coordinator: Coordinator) -> Iterator[None]:
    """The context of an evaluate/run call; see [Note: inference calls]. Collective at stage 3.
    ``coordinator``: the engine's (fetch/build.py; stage 0's only moves its phase)."""
    was_training = model.training
    coordinator.begin_inference()
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        try:
            coordinator.end_inference()
        finally:
            model.train(was_training)


def failed_ranks(group: Group, waiter: Waiter, failed: bool, device: torch.device) -> List[int]:
    """The ranks whose call raised, agreed by every rank in one all-reduce (collective)."""
    if group.world_size == 1:
        return [0] if failed else []
    flags = torch.zeros(group.world_size, dtype=torch.float32, device=device)
    flags[group.rank] = float(failed)
    waiter.until_complete(group.all_reduce(flags, async_op=True, control=True))
    return [r for r, f in enumerate(flags.tolist()) if f]


def evaluation(loss_fn: Callable, metric_fn: Optional[Callable]) -> Callable[[torch.nn.Module, Any], Dict[str, float]]:
    """``fn(model, rows) -> {"loss": float, **metrics}``: what one rank reports for one batch."""
    def evaluate(model: torch.nn.Module, rows: Any) -> Dict[str, float]:
        loss = loss_fn(model, rows)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"evaluate: loss_fn must return a scalar tensor (the mean loss over the rows), "
                             f"got {shape}")
        out = {"loss": float(loss)}
        if metric_fn is not None:
            metrics = metric_fn(model, rows)
            if not isinstance(metrics, dict):
                raise ValueError("evaluate: metric_fn(model, batch) must return a dict of name -> float (or 0-dim "
                                 f"tensor), got {type(metrics).__name__}")
            for name, value in metrics.items():
                if not isinstance(name, str) or name == "loss":
                    raise ValueError(f"evaluate: metric_fn returned the key {name!r}: metric names are strings "
                                     "other than 'loss' (evaluate reports loss_fn's value under 'loss')")
                out[name] = _scalar(name, value)
        return out
    return evaluate


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(f"evaluate: metric_fn's {name!r} is {shape}, not a number: return a float or a 0-dim tensor "
                     "(the mean over the rows; evaluate averages it over workers and batches)")


def to_cpu(value: Any) -> Any:
    """A result ready to leave the worker: every tensor in it (through dicts, lists and tuples)
    copied to the CPU, detached. A copy, since at stage 3 a tensor may be a view of a unit's
    gathered buffer, which is freed when the call ends."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = value.copy()
        for key, item in value.items():
            out[key] = to_cpu(item)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
