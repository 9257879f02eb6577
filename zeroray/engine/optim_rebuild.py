"""What a restore rebuilds from a checkpoint's optimizer record, which is data only
([Note: optimizer record] in engine/optim_record.py); see [Note: rebuilt from data].

[Note: rebuilt from data]
A checkpoint names classes; it never says where to import code from. A restore that is not
given an optimizer, param_groups or scheduler rebuilds the checkpoint's from its record:
- one of zeroray's specs (zr.Adam, zr.AdamW, zr.SGD) from its class name and fields;
- for a callable spec, the torch optimizer it built, when that class is one of torch.optim's
  own (looked up by name in ``torch.optim``, and only there), called with its recorded
  ``defaults`` as keyword arguments. A probe checks that this builds every recorded group's
  initial hyperparameters, so a callable that did more than call the class (it changed the
  groups it was given) is not taken for it. One declared element-wise (``zr.elementwise(fn)``) is
  rebuilt declared so, so that it takes the path it was saved on (flat pieces, whose state the
  checkpoint holds: [Note: optimizer paths] in engine/optim_choice.py);
- the param_groups overrides, as a table by parameter name (``NamedOverrides``): what the
  callable returned for each parameter is data, and the restored model has the same
  parameter names (restore checks them);
- an LR scheduler of ``torch.optim.lr_scheduler`` whose whole state is data (``SCHEDULERS``):
  built with constructor arguments read from its recorded state, which then loads over it.
  LambdaLR and MultiplicativeLR hold functions, SequentialLR and ChainedScheduler other
  schedulers, CyclicLR may hold a scale function its state_dict does not show, and
  ReduceLROnPlateau needs a metric that zeroray's step does not give it: those are code.
Anything else (a user's own optimizer or scheduler class, a hyperparameter that is not data)
raises ``RebuildError`` naming what the checkpoint used and what to pass to restore instead.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch.optim import lr_scheduler

from zeroray.config import Elementwise, optimizer_spec_class
from zeroray.engine.optim_record import (PER_GROUP_STATE, decode, decode_hyperparameters, hyperparameters,
                                         load_scheduler_state, name_list, probe, qualified_name)


class RebuildError(ValueError):
    """The checkpoint's optimizer, param_groups or scheduler is code, not data: restate it."""


@dataclass(frozen=True)
class TorchOptimizer:
    """A callable spec rebuilt from a record: ``torch.optim.<name>(params, **kwargs)``."""

    name: str
    kwargs: Dict[str, Any] = field(default_factory=dict)  # in the record's JSON form

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return getattr(torch.optim, self.name)(params, **decode_hyperparameters(self.kwargs))


@dataclass(frozen=True)
class NamedOverrides:
    """A param_groups rebuilt from a record: each parameter's recorded overrides, by name."""

    table: Dict[str, Dict[str, Any]]  # parameter name -> overrides, in the record's JSON form

    def __call__(self, name: str, param: Any) -> Dict[str, Any]:
        return decode_hyperparameters(self.table.get(name, {}))


@dataclass(frozen=True)
class TorchScheduler:
    """A scheduler rebuilt from a record: ``torch.optim.lr_scheduler.<name>(optimizer, **kwargs)``;
    the recorded state then loads over it (engine/optim.py's ``import_state``)."""

    name: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def __call__(self, optimizer: Any) -> Any:
        return getattr(lr_scheduler, self.name)(optimizer, **{k: decode(v, tuples=False)
                                                              for k, v in self.kwargs.items()})


def _from_state(*names: str) -> Callable[[Mapping[str, Any]], Dict[str, Any]]:
    return lambda state: {n: state[n] for n in names}


# The schedulers whose state is data: for each, its constructor's arguments from its recorded
# state (the state loads over what they build). tests/unit/test_optimizer_record.py checks that
# each one rebuilt goes on exactly as the original.
SCHEDULERS: Dict[str, Callable[[Mapping[str, Any]], Dict[str, Any]]] = {
    "StepLR": _from_state("step_size", "gamma"),
    "MultiStepLR": lambda s: {"milestones": sorted(decode(s["milestones"], tuples=False).elements()),
                              "gamma": s["gamma"]},
    "ConstantLR": _from_state("factor", "total_iters"),
    "LinearLR": _from_state("start_factor", "end_factor", "total_iters"),
    "ExponentialLR": _from_state("gamma"),
    "PolynomialLR": _from_state("total_iters", "power"),
    "CosineAnnealingLR": _from_state("T_max", "eta_min"),
    "CosineAnnealingWarmRestarts": _from_state("T_0", "T_mult", "eta_min"),
    # max_lr is a placeholder: each group's initial_lr, max_lr and min_lr load from the record
    "OneCycleLR": lambda s: {"max_lr": 1.0, "total_steps": s["total_steps"], "anneal_strategy": s["_anneal_func_type"],
                             "cycle_momentum": s["cycle_momentum"]},
}


def _restate(what: str, example: str) -> str:
    return (f"pass the same one to restore, e.g. Trainer.restore(path, model_fn, loss_fn, {what}={example}); "
            "the checkpoint's state then loads into it")


def rebuild_optimizer(record: Mapping[str, Any]) -> Any:
    """The optimizer spec the record describes; RebuildError if it is code."""
    spec = record["spec"]
    if spec["kind"] == "zeroray":
        cls = optimizer_spec_class(spec["class"])
        if cls is None:
            raise RebuildError(f"the checkpoint was saved with optimizer zr.{spec['class']}, which this zeroray "
                               f"does not have: {_restate('optimizer', 'zr.AdamW(...)')}")
        rebuilt: Any = cls(**decode_hyperparameters(spec["fields"]))
    elif spec["kind"] == "elementwise":
        rebuilt = Elementwise(_rebuild_torch_optimizer(record, spec["name"], elementwise=True))
    else:
        rebuilt = _rebuild_torch_optimizer(record, spec["name"])
    check_rebuilt(rebuilt, record)
    return rebuilt


def _rebuild_torch_optimizer(record: Mapping[str, Any], made_by: str, elementwise: bool = False) -> TorchOptimizer:
    """``torch.optim.<class>(params, **defaults)`` as the record names it; ``elementwise``: the spec
    was ``zr.elementwise(made_by)``, which a restatement keeps."""
    name = record["class"]
    if elementwise:
        made_by = f"zr.elementwise({made_by})"
    if name is None:
        raise RebuildError(f"the checkpoint does not say which torch optimizer {made_by} built (it could not be "
                           f"built over a probe parameter when saved): {_restate('optimizer', made_by)}")
    short = name.rsplit(".", 1)[-1]
    cls = getattr(torch.optim, short, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and qualified_name(cls) == name):
        raise RebuildError(
            f"the checkpoint was saved with optimizer {name} (built by {made_by}), which is not one of torch.optim's "
            "own classes; zeroray rebuilds only those and its own specs from a checkpoint, which names no code to "
            f"import: {_restate('optimizer', _wrapped('lambda params: ' + short + '(params, ...)', elementwise))}")
    if record["unrecorded"]:
        raise RebuildError(f"the checkpoint's optimizer {name} has hyperparameters that are not data "
                           f"({', '.join(record['unrecorded'])}), so it cannot be rebuilt: "
                           f"{_restate('optimizer', made_by)}")
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in record["defaults"].items() if k in params}
    missing = [n for n, p in params.items() if n not in ("self", "params") and p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if missing:
        raise RebuildError(f"the checkpoint's optimizer {name} needs {missing}, which its defaults do not record: "
                           f"{_restate('optimizer', made_by)}")
    return TorchOptimizer(short, kwargs)


def _wrapped(example: str, elementwise: bool) -> str:
    return f"zr.elementwise({example})" if elementwise else example


def check_rebuilt(rebuilt: Any, record: Mapping[str, Any]) -> None:
    """RebuildError unless ``rebuilt`` builds every recorded group's initial hyperparameters."""
    builder = rebuilt.build if hasattr(rebuilt, "build") else rebuilt
    for g in record["groups"]:
        if g.get("initial") is None:
            continue
        built, _ = probe(builder, [decode_hyperparameters(g["overrides"])])
        got = hyperparameters(built.param_groups[0]) if built is not None else None
        if got != g["initial"]:
            diff = (sorted(k for k in set(got) | set(g["initial"]) if got.get(k) != g["initial"].get(k))
                    if got is not None else "it cannot be built")
            raise RebuildError(
                f"the checkpoint's optimizer ({record['spec'].get('name') or record['spec'].get('class')}) built the "
                f"param group of {name_list(g['params'])} with other hyperparameters than {record['class']}(params, "
                f"**its defaults) gives ({diff}): it did more than call the class, so it is code: "
                f"{_restate('optimizer', '...')}")


def rebuild_param_groups(record: Mapping[str, Any]) -> Optional[NamedOverrides]:
    """The recorded overrides by parameter name (None when no parameter had any)."""
    table: Dict[str, Dict[str, Any]] = {}
    for g in record["groups"]:
        if g.get("unrecorded"):
            raise RebuildError(f"param_groups ({record['param_groups']}) gave {name_list(g['params'])} overrides that "
                               f"are not data ({', '.join(g['unrecorded'])}): {_restate('param_groups', '...')}")
        if g["overrides"]:
            table.update({name: g["overrides"] for name in g["params"]})
    return NamedOverrides(table) if table else None


def rebuild_scheduler(record: Mapping[str, Any]) -> TorchScheduler:
    """The recorded scheduler, when its class is one of ``SCHEDULERS``; else RebuildError."""
    name = record["class"]
    short = name.rsplit(".", 1)[-1]
    cls = getattr(lr_scheduler, short, None)
    example = f"lambda opt: {short}(opt, ...)"
    if short not in SCHEDULERS or not isinstance(cls, type) or qualified_name(cls) != name:
        why = ("it is not one of torch.optim.lr_scheduler's own classes" if short not in SCHEDULERS
               and not (isinstance(cls, type) and qualified_name(cls) == name)
               else "its state holds code or other schedulers, or it needs what zeroray's step does not give it")
        raise RebuildError(f"the checkpoint's LR scheduler is {name} ({record.get('name')}), which zeroray does not "
                           f"rebuild from a checkpoint: {why}. {_restate('scheduler', example)} "
                           "(its step counts and the rest of its state)")
    if record["unrecorded"]:
        raise RebuildError(f"the checkpoint's LR scheduler {name} has state that is not data "
                           f"({', '.join(record['unrecorded'])}): {_restate('scheduler', example)}")
    state = record["current"]
    try:
        return TorchScheduler(short, SCHEDULERS[short](state))
    except KeyError as e:
        raise RebuildError(f"the checkpoint's LR scheduler {name} does not record {e}: "
                           f"{_restate('scheduler', example)}") from None


def check_scheduler(rebuilt: Callable[[Any], Any], optimizer: Any, record: Mapping[str, Any]) -> None:
    """RebuildError unless the recorded state, loaded into ``rebuilt`` built on a probe of
    ``optimizer`` (a spec), is all of its state: nothing it holds is left at the placeholders."""
    builder = optimizer.build if hasattr(optimizer, "build") else optimizer
    built, _ = probe(builder, [{}])
    if built is None:
        return  # the workers' build says what is wrong with the optimizer
    try:
        scheduler = rebuilt(built)
    except Exception as error:  # noqa: BLE001 - torch's own reason, said as what to do
        raise RebuildError(f"the checkpoint's LR scheduler {record['class']} cannot be built on this optimizer "
                           f"({type(error).__name__}: {error}): {_restate('scheduler', '...')}") from None
    load_scheduler_state(scheduler, record["current"])
    held = set(scheduler.state_dict()) - set(PER_GROUP_STATE)
    if held != set(record["current"]):
        raise RebuildError(f"the checkpoint's LR scheduler {record['class']} records {sorted(record['current'])} "
                           f"but holds {sorted(held)}: {_restate('scheduler', '...')}")
