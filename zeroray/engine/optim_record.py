"""The optimizer as data: what a checkpoint records of the optimizer, its param groups and its
LR scheduler, so that a restore can continue with them ([Note: optimizer record]).

[Note: optimizer record]
PyTorch's ``optimizer.state_dict()`` holds every param group's hyperparameters beside the
state, and ``load_state_dict`` puts them back: a resumed run trains on with the optimizer it
was saved with. A zeroray checkpoint records the same as data, in the manifest's ``optimizer``
entry (JSON: a checkpoint never holds code, nothing here is pickled):

- ``spec``: what the Trainer was given: one of zeroray's specs by class and fields
  (``{"kind": "zeroray", "class": "AdamW", "fields": {...}}``); a callable declared element-wise
  with ``zr.elementwise(fn)`` as ``{"kind": "elementwise", "name": ...}`` (``fn``'s qualified
  name, for messages only: the declaration is what is recorded, and a rebuild keeps it, so the
  rebuilt optimizer takes the path the saved one took, [Note: optimizer paths] in
  engine/optim_choice.py); any other callable as ``{"kind": "callable", "name": ...}``;
- ``class``: the torch optimizer the spec built, by qualified name; ``defaults``: its
  JSON-able ``defaults``; ``unrecorded``: the names of those that are not (a Tensor ``lr``);
- ``state_keys``: its per-parameter state keys (``exp_avg``, ...), from one step of a probe;
- ``groups``: one per distinct ``param_groups`` overrides (zeroray's torch param groups are
  keyed by them: ``group_key``): the ``overrides`` (and the names of those ``unrecorded``),
  the ``params`` (names) that got them, the
  ``initial`` hyperparameters the spec builds for them and the ``current`` ones at the save
  (a scheduler moves ``lr``; OneCycleLR moves the momentum too);
- ``param_groups``: None, or the name of the callable that gave the overrides;
- ``scheduler``: None, or its ``class`` (qualified name), ``name``, ``initial`` state (as
  built on the probe), ``current`` state, and ``unrecorded``. A state is the scheduler's
  JSON-able ``state_dict()`` entries less the per-group lists ``base_lrs`` and ``_last_lr``,
  which each group's ``initial_lr`` and ``lr`` give (a rank holds only some of the groups).

"initial" comes from a *probe*: the same spec (and scheduler) built over one 1-element-by-1
parameter per group. With both initial and current values the record says what the user
asked for and where the run got to, so a restore can tell a hyperparameter the user restated
(its initial value differs) from one the scheduler moved (runtime/controller/optimizer_restore.py).

Values: JSON's numbers, strings, booleans and null as themselves; sequences as lists, which
hyperparameters read back as tuples (torch's ``betas``, ``etas``); a ``collections.Counter``
(MultiStepLR's milestones) as ``{"Counter": [[key, count], ...]}``. Anything else is not
recorded, and its name is listed in ``unrecorded``.

Each rank sees only the groups of its own shard, so each rank writes its part
(``record_part``) and the driver merges the parts (``merge_parts``).
"""
from __future__ import annotations

import collections
import json
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from zeroray.config import Elementwise, optimizer_spec_class
from zeroray.layout.owners import is_owned_key

RECORD_VERSION = 1
PER_GROUP_STATE = ("base_lrs", "_last_lr")  # a scheduler's lists, one entry per param group
_NOT_HYPERPARAMETERS = ("params", "param_names")
_COUNTER = "Counter"


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function (what a record names it by)."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def name_list(names: List[str], shown: int = 3) -> str:
    """The first few of ``names`` for a message: ``a, b, c (+4 more)``."""
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def group_key(overrides: Mapping[str, Any]) -> str:
    """The key of the param group that ``overrides`` (what ``param_groups(name, param)`` returned)
    give: equal overrides, one group (engine/optim.py's ``Segment.key``)."""
    return json.dumps(dict(overrides), sort_keys=True, default=str)


# --- values ------------------------------------------------------------------------------------


def encode(value: Any) -> Tuple[bool, Any]:
    """(True, the JSON form) of a value the record can hold, else (False, None)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, collections.Counter):
        items = [(k, n) for k, n in value.items()]
        if all(isinstance(k, (int, str)) and isinstance(n, int) for k, n in items):
            return True, {_COUNTER: [[k, n] for k, n in items]}
        return False, None
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            ok, e = encode(v)
            if not ok:
                return False, None
            out.append(e)
        return True, out
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and set(value) != {_COUNTER}:
        encoded, unrecorded = encode_mapping(value)
        return (True, encoded) if not unrecorded else (False, None)
    return False, None


def encode_mapping(mapping: Mapping[str, Any], skip: Iterable[str] = ()) -> Tuple[Dict[str, Any], List[str]]:
    """(the recordable entries of ``mapping`` in JSON form, the sorted names of the others)."""
    skip = set(skip)
    out: Dict[str, Any] = {}
    unrecorded: List[str] = []
    for key, value in mapping.items():
        if key in skip:
            continue
        ok, e = encode(value)
        if ok:
            out[key] = e
        else:
            unrecorded.append(key)
    return out, sorted(unrecorded)


def decode(value: Any, tuples: bool) -> Any:
    """A recorded value back in Python: lists as tuples when ``tuples`` (hyperparameters)."""
    if isinstance(value, dict):
        if set(value) == {_COUNTER}:
            return collections.Counter({k: n for k, n in value[_COUNTER]})
        return {k: decode(v, tuples) for k, v in value.items()}
    if isinstance(value, list):
        items = [decode(v, tuples) for v in value]
        return tuple(items) if tuples else items
    return value


def hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    """A torch param group's JSON-able hyperparameters (everything but its params)."""
    return encode_mapping(group, skip=_NOT_HYPERPARAMETERS)[0]


def decode_hyperparameters(encoded: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: decode(v, tuples=True) for k, v in encoded.items()}


# --- the scheduler's state ------------------------------------------------------------------------


def scheduler_state(scheduler: Any) -> Dict[str, Any]:
    """The scheduler's recordable state (see [Note: optimizer record]): the same on every rank."""
    return encode_mapping(scheduler.state_dict(), skip=PER_GROUP_STATE)[0]


def load_scheduler_state(scheduler: Any, state: Mapping[str, Any]) -> None:
    """Load a recorded ``state`` into ``scheduler``, whose optimizer's groups already hold their
    hyperparameters: ``base_lrs`` from their ``initial_lr`` (where the scheduler set one) and
    ``_last_lr`` from their ``lr``, as the run that saved had them."""
    sd = scheduler.state_dict()
    sd.update({k: decode(v, tuples=False) for k, v in state.items()})
    groups = scheduler.optimizer.param_groups
    if all("initial_lr" in g for g in groups):
        sd["base_lrs"] = [g["initial_lr"] for g in groups]
    sd["_last_lr"] = [g["lr"] for g in groups]
    scheduler.load_state_dict(sd)


# --- a rank's part, and the driver's merge ----------------------------------------------------------


def probe(builder: Callable[[Any], Any], overrides: List[Mapping[str, Any]],
          device: Any = "cpu") -> Tuple[Optional[Any], List[torch.nn.Parameter]]:
    """The spec built over one (1, 1) parameter per group of ``overrides`` (a shape every torch
    optimizer takes, Muon's 2-D one too), and those parameters; (None, []) if it cannot be."""
    params = [torch.nn.Parameter(torch.zeros(1, 1, device=device)) for _ in overrides]
    try:
        optimizer = builder([{"params": [p], **dict(o)} for p, o in zip(params, overrides)])
    except Exception:  # noqa: BLE001 - a spec that cannot build a probe: its initial values are unknown
        return None, []
    return (optimizer, params) if isinstance(optimizer, torch.optim.Optimizer) else (None, [])


def probe_state_keys(optimizer: Any, params: List[torch.nn.Parameter]) -> Optional[List[str]]:
    """The state keys one step of the probe creates; None if it cannot step."""
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimizer that needs a closure, sparse gradients, ...
        return None
    return sorted({k for p in params for k in optimizer.state.get(p, {})})


def record_part(builder: Callable[[Any], Any], scheduler_fn: Optional[Callable[[Any], Any]],
                groups: Mapping[str, Mapping[str, Any]], scheduler: Any,
                param_overrides: Mapping[str, Mapping[str, Any]], device: Any = "cpu") -> Dict[str, Any]:
    """This rank's part of the record: ``groups`` its param groups' current values by
    ``group_key``, ``scheduler`` its live scheduler (or None), ``param_overrides`` what
    ``param_groups`` gave each of its parameters, by name."""
    by_key: Dict[str, Dict[str, Any]] = {}
    given: Dict[str, Mapping[str, Any]] = {}  # key -> the overrides as param_groups returned them
    for name, overrides in param_overrides.items():
        key = group_key(overrides)
        given.setdefault(key, overrides)
        if key not in by_key:
            encoded, unrecorded = encode_mapping(overrides)
            by_key[key] = {"key": key, "overrides": encoded, "unrecorded": unrecorded, "params": []}
        by_key[key]["params"].append(name)
    keys = list(by_key)
    built, params = probe(builder, [given[k] for k in keys], device) if keys else (None, [])
    part: Dict[str, Any] = {"class": None, "defaults": {}, "unrecorded": [], "state_keys": None, "scheduler": None}
    if built is not None:
        part["class"] = qualified_name(type(built))
        part["defaults"], part["unrecorded"] = encode_mapping(built.defaults)
        for key, group in zip(keys, built.param_groups):
            by_key[key]["initial"] = hyperparameters(group)
    for key in keys:
        by_key[key].setdefault("initial", None)
        by_key[key]["current"] = hyperparameters(groups[key]) if key in groups else None
    part["groups"] = list(by_key.values())
    if scheduler is not None:
        sched_part: Dict[str, Any] = {"class": qualified_name(type(scheduler)), "name": qualified_name(scheduler_fn),
                                      "initial": None}
        sched_part["current"], sched_part["unrecorded"] = encode_mapping(scheduler.state_dict(),
                                                                         skip=PER_GROUP_STATE)
        if built is not None and scheduler_fn is not None:
            try:
                sched_part["initial"] = scheduler_state(scheduler_fn(built))
            except Exception:  # noqa: BLE001 - a scheduler that cannot be built on the probe: initial unknown
                pass
        part["scheduler"] = sched_part
    if built is not None:
        part["state_keys"] = probe_state_keys(built, params)
    return part


def describe_spec(spec: Any) -> Dict[str, Any]:
    """What the Trainer was given as the optimizer: zeroray's spec by class and fields, or a callable's
    name, and whether it was declared element-wise."""
    if isinstance(spec, Elementwise):
        return {"kind": "elementwise", "name": qualified_name(spec.fn)}
    if is_dataclass(spec) and optimizer_spec_class(type(spec).__name__) is type(spec):
        values, unrecorded = encode_mapping({f.name: getattr(spec, f.name) for f in fields(spec)})
        if not unrecorded:
            return {"kind": "zeroray", "class": type(spec).__name__, "fields": values}
    return {"kind": "callable", "name": qualified_name(spec)}


def merge_parts(parts: List[Mapping[str, Any]], spec: Any, param_groups: Optional[Callable]) -> Dict[str, Any]:
    """The whole record from every rank's ``record_part``: groups merged by key (their params
    in rank order), the rest from the first rank that has it."""
    groups: Dict[str, Dict[str, Any]] = {}
    for part in parts:
        for g in part["groups"]:
            merged = groups.setdefault(g["key"], {**g, "params": []})
            merged["params"] += [n for n in g["params"] if n not in merged["params"]]
            for field in ("initial", "current"):
                if merged[field] is None:
                    merged[field] = g[field]
    first = next((p for p in parts if p["class"] is not None), parts[0])
    return {
        "version": RECORD_VERSION,
        "spec": describe_spec(spec),
        "class": first["class"], "defaults": first["defaults"], "unrecorded": first["unrecorded"],
        "state_keys": first["state_keys"],
        "groups": list(groups.values()),
        "param_groups": qualified_name(param_groups) if param_groups is not None else None,
        "scheduler": next((p["scheduler"] for p in parts if p["scheduler"] is not None), None),
    }


_RECORD_FIELDS = {"version": int, "spec": dict, "class": (str, type(None)), "defaults": dict, "unrecorded": list,
                  "state_keys": (list, type(None)), "groups": list, "param_groups": (str, type(None)),
                  "scheduler": (dict, type(None))}
_GROUP_FIELDS = {"key": str, "overrides": dict, "unrecorded": list, "params": list, "initial": (dict, type(None)),
                 "current": (dict, type(None))}


def check_record(record: Any, source: Any) -> None:
    """ValueError, saying what is wrong and what to do, unless ``record`` has the record's form."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{source}: the checkpoint's optimizer record is damaged ({what}); restore with "
                          "optimizer=, param_groups= and scheduler= given, or load another checkpoint")

    if not isinstance(record, dict):
        raise bad(f"a {type(record).__name__}, not an object")
    if record.get("version") != RECORD_VERSION:
        raise bad(f"version {record.get('version')!r}, this zeroray reads {RECORD_VERSION}")
    for name, types in _RECORD_FIELDS.items():
        if not isinstance(record.get(name, ...), types):
            raise bad(f"field {name!r}")
    for g in record["groups"]:
        for name, types in _GROUP_FIELDS.items():
            if not isinstance(g, dict) or not isinstance(g.get(name, ...), types):
                raise bad(f"a param group's field {name!r}")


def with_plan(tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any], plan: Mapping[str, Any]
              ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A rank's loaded (tensors, scalars) as a restore's plan says (runtime/controller/optimizer_restore.py's
    ``LoadPlan``): each group's hyperparameters and the scheduler's state from ``plan``, and with
    ``fresh_optimizer`` no optimizer state at all (neither path's: flat pieces' nor whole parameters')."""
    scalars = {**scalars, "groups": plan["groups"], "scheduler": plan["scheduler"]}
    if plan["fresh_optimizer"]:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("optim.") and not is_owned_key(k)}
        scalars = {k: v for k, v in scalars.items()
                   if not k.startswith("optim.") and k not in ("optim_per_element", "group_lr", "optim_path")}
    return tensors, scalars
