"""Trainer.restore's optimizer: what a restored trainer builds (``choose``, before any worker
starts) and what of the checkpoint's optimizer it loads (``plan_load``, at every load of a
checkpoint: restore, and recovery from one); see [Note: restoring the optimizer].

[Note: restoring the optimizer]
As in PyTorch, where ``optimizer.load_state_dict`` restores each param group's hyperparameters
with the state and ``scheduler.load_state_dict`` the schedule's position, a restore continues
the run that was saved:
- Nothing given: the checkpoint's optimizer, param groups and LR scheduler, rebuilt from its
  record where they are data ([Note: rebuilt from data] in engine/optim_rebuild.py; an error
  before any worker starts where they are code), then the checkpoint's state: the optimizer's
  state, every group's current hyperparameters, the scheduler's state.
- ``optimizer=``, ``param_groups=`` or ``scheduler=`` given: it replaces the checkpoint's.
  The record holds each group's hyperparameters as the spec built them (``initial``) and as
  they were at the save (``current``: a scheduler moves lr). A hyperparameter whose initial
  value the new spec changes takes the new value, and the log says so ("restore: optimizer
  AdamW: weight_decay 0.0 -> 0.01 (from optimizer= given to restore)"); the others take the
  checkpoint's current value, so restating the same optimizer changes nothing (its lr stays
  where the scheduler had moved it). A scheduler given of the checkpoint's class loads the
  checkpoint's state by the same rule (a changed step_size is taken, the step counts load);
  one of another class starts from its beginning, with each group's lr as the new build set it.
- The optimizer state (moments, step counts) loads when it fits: the new optimizer keeps the
  same state keys as the checkpoint's (a probe step of each says which). Otherwise a restore is
  an error unless ``fresh_optimizer=True``, which starts the optimizer and its scheduler over
  (no state, the spec's own hyperparameters) and keeps the weights and the step count.
- A checkpoint from before the record: the optimizer given, or the default AdamW() with a
  warning that the checkpoint does not say which optimizer it was saved with; each group's lr
  and the scheduler's counters load as before.
Recovery after a failure inside ``fit`` loads a checkpoint through the same plan with the
live spec (the restored trainer's choice), so it goes on exactly as before the failure.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from zeroray.config import AdamW
from zeroray.engine.optim import group_table
from zeroray.engine.optim_rebuild import (RebuildError, check_scheduler, rebuild_optimizer, rebuild_param_groups,
                                          rebuild_scheduler)
from zeroray.engine.optim_record import check_record, name_list, probe, probe_state_keys
from zeroray.runtime.records import OptimizerPlan

log = logging.getLogger("zeroray")

PARTS = ("optimizer", "param_groups", "scheduler")


@dataclass(frozen=True)
class RestoreChoice:
    """What a trainer builds its optimizer from, and which of it the caller gave (the others
    were rebuilt from the checkpoint). A trainer not restored gave all three."""

    optimizer: Any
    param_groups: Optional[Callable] = None
    scheduler: Optional[Callable] = None
    given: FrozenSet[str] = frozenset(PARTS)
    fresh_optimizer: bool = False


@dataclass(frozen=True)
class LoadPlan:
    """What a load takes of the checkpoint's optimizer: ``groups``, each param group's
    hyperparameters to set, by group key (JSON form); ``scheduler``, the state to load (None:
    the scheduler, if any, starts from its beginning); ``fresh_optimizer``: no optimizer state."""

    groups: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    scheduler: Optional[Dict[str, Any]] = None
    fresh_optimizer: bool = False
    lines: Tuple[str, ...] = ()

    def for_workers(self) -> OptimizerPlan:
        return OptimizerPlan(self.groups, self.scheduler, self.fresh_optimizer)


def choose(record: Optional[Mapping[str, Any]], source: Any, given: Mapping[str, Any],
           fresh_optimizer: bool = False) -> RestoreChoice:
    """What a restore from the checkpoint at ``source`` (whose optimizer record is ``record``)
    builds; ``given``: what the caller passed of optimizer, param_groups, scheduler (None: not
    given). Raises RebuildError (a ValueError) for what cannot be rebuilt, before any worker starts."""
    named = {k: v for k, v in given.items() if k in PARTS and v is not None}
    if record is not None:
        check_record(record, source)
    if record is None:
        if "optimizer" not in named:
            log.warning("zeroray: restore: %s does not say which optimizer it was saved with (it was saved before "
                        "zeroray recorded it); continuing with the default AdamW() and each param group's lr from "
                        "the checkpoint: pass optimizer=... to restore the one it was trained with", source)
        return RestoreChoice(named.get("optimizer") or AdamW(), named.get("param_groups"), named.get("scheduler"),
                             frozenset(named), fresh_optimizer)
    try:
        optimizer = named["optimizer"] if "optimizer" in named else rebuild_optimizer(record)
        param_groups = named["param_groups"] if "param_groups" in named else rebuild_param_groups(record)
        scheduler = named.get("scheduler")
        if scheduler is None and record["scheduler"] is not None:
            scheduler = rebuild_scheduler(record["scheduler"])
            check_scheduler(scheduler, optimizer, record["scheduler"])
    except RebuildError as error:
        raise RebuildError(f"Trainer.restore({source!s}): {error}") from None
    if "optimizer" in named and not fresh_optimizer:
        builder = optimizer.build if hasattr(optimizer, "build") else optimizer
        built, params = probe(builder, [{}])
        if built is not None:  # else the workers' probe says (plan_load)
            check_state_fits(record, {"class": _class_of(built), "state_keys": probe_state_keys(built, params)})
    return RestoreChoice(optimizer, param_groups, scheduler, frozenset(named), fresh_optimizer)


def _class_of(optimizer: Any) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check_state_fits(record: Mapping[str, Any], live: Mapping[str, Any]) -> None:
    """ValueError unless the checkpoint's optimizer state fits the new optimizer: the same state
    keys, or none saved. Unknown keys (a probe that could not step) are taken to fit."""
    old, new = record.get("state_keys"), live.get("state_keys")
    if old is None or new is None or not old or old == new:
        return
    raise ValueError(
        f"restore: the optimizer given to restore ({_short(live['class'])}) keeps state {new}, and the "
        f"checkpoint's ({_short(record['class'])}) saved {old}: that state does not fit it. Pass "
        "fresh_optimizer=True to start the optimizer's state (and its scheduler) fresh, keeping the weights and "
        "the step count, or restore with the checkpoint's optimizer (leave optimizer= out)")


def _short(name: Optional[str]) -> str:
    return (name or "?").rsplit(".", 1)[-1]


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def plan_load(record: Optional[Mapping[str, Any]], scalars: Sequence[Mapping[str, Any]],
              live: Mapping[str, Any], choice: RestoreChoice, fresh: bool = False) -> LoadPlan:
    """What a load of a checkpoint takes of its optimizer: ``record`` its optimizer record (None
    for a checkpoint from before it), ``scalars`` its ranks' scalars, ``live`` the record of the
    workers' own build (merged ``record_part``s: current values as built), ``choice`` what was
    given, ``fresh`` whether this load starts the optimizer fresh. See [Note: restoring the optimizer]."""
    if fresh:
        return LoadPlan(fresh_optimizer=True, lines=(
            "restore: the optimizer starts fresh (fresh_optimizer=True): no moments or step counts from the "
            "checkpoint, its hyperparameters as built, its scheduler from the beginning",))
    if record is None:
        return _plan_without_record(scalars)
    check_state_fits(record, live)
    lines: List[str] = []
    changed = set()  # what differs from the checkpoint's: only what the caller gave may
    if record["class"] != live["class"] and live["class"] is not None:
        changed.add("optimizer")
        lines.append(f"restore: optimizer {_short(record['class'])} -> {_short(live['class'])} "
                     "(from optimizer= given to restore); its state loads, the keys fit")
    sched_fresh, sched_state, sched_lines = _plan_scheduler(record["scheduler"], live["scheduler"], choice)
    changed |= {"scheduler"} if sched_lines else set()
    groups, changes = _plan_groups(record, live, choice, sched_fresh)
    changed |= {c[3] for _, group_changes in changes for c in group_changes}
    lines += _change_lines(live, changes) + sched_lines
    if changed - choice.given:
        # the trainer was built from another checkpoint's record (a fallback restore's newest)
        raise ValueError(f"restore: this checkpoint was saved with another {' and '.join(sorted(changed - choice.given))}"
                         " than the one restore rebuilt (from the newest checkpoint's record): restore this checkpoint "
                         "by its own path, or pass optimizer=, param_groups= and scheduler=")
    if not lines and not (choice.given & {"optimizer", "param_groups"}):
        sched = record["scheduler"]
        lines.append(f"restore: optimizer {describe(record)}, {len(record['groups'])} param group(s)"
                     + (f", scheduler {_short(sched['class'])} (step {sched['current'].get('last_epoch')})"
                        if sched is not None else "") + ", all from the checkpoint")
    return LoadPlan(groups=groups, scheduler=sched_state, lines=tuple(lines))


def _plan_without_record(scalars: Sequence[Mapping[str, Any]]) -> LoadPlan:
    """A checkpoint from before the record: each group's lr (every rank's groups merged: a rank
    holds only some) and the scheduler's counters, as zeroray loaded them then."""
    groups: Dict[str, Dict[str, Any]] = {}
    for s in scalars:
        for key, values in group_table(s).items():
            groups.setdefault(key, values)
    sched = next((s["scheduler"] for s in scalars if s.get("scheduler") is not None), None)
    return LoadPlan(groups=groups, scheduler=sched)


_Changes = List[Tuple[Mapping[str, Any], List[Tuple[str, Any, Any, str]]]]  # (group, [(key, old, new, source)])


def _plan_groups(record: Mapping[str, Any], live: Mapping[str, Any], choice: RestoreChoice,
                 sched_fresh: bool) -> Tuple[Dict[str, Dict[str, Any]], _Changes]:
    """Each live group's hyperparameters, by group key: what the new build changed, else the
    checkpoint's current value (the checkpoint's group is found by the live group's parameters);
    and the changes, per group."""
    old_of = {name: g for g in record["groups"] for name in g["params"]}
    table: Dict[str, Dict[str, Any]] = {}
    changes: _Changes = []
    for g in live["groups"]:
        olds = list({id(old_of[n]): old_of[n] for n in g["params"] if n in old_of}.values())
        values: Dict[str, Any] = {}
        changed: List[Tuple[str, Any, Any, str]] = []
        for k, new in (g["current"] or {}).items():
            if sched_fresh and _scheduler_owned(k, new, g["initial"]):
                values[k] = new  # a new schedule starts from what its construction set
                continue
            values[k], before = _resolve(k, new, g["initial"], olds)
            if before is not _UNCHANGED:
                changed.append((k, before, new, _source(k, g, olds, choice)))
        table[g["key"]] = values
        if changed:
            changes.append((g, changed))
    return table, changes


_UNCHANGED = object()


def _scheduler_owned(k: str, value: Any, initial: Optional[Mapping[str, Any]]) -> bool:
    """Whether a group's ``k`` is the scheduler's: lr, or one its construction added or moved."""
    return k == "lr" or (initial is not None and (k not in initial or not _same(initial[k], value)))


def _resolve(k: str, new: Any, initial: Optional[Mapping[str, Any]], olds: List[Mapping[str, Any]]
             ) -> Tuple[Any, Any]:
    """(the value of hyperparameter ``k`` of a live group built with ``new`` (as built:
    ``initial``), what it changes from, or _UNCHANGED) given the checkpoint's groups ``olds``
    of its parameters."""
    if not olds:
        return new, _UNCHANGED  # no parameter of it was in the checkpoint's groups
    seen = {json.dumps([o["initial"].get(k) if o["initial"] is not None else "?",
                        k in (o["current"] or {}), (o["current"] or {}).get(k)], sort_keys=True) for o in olds}
    if len(seen) > 1:
        return new, "(differed between the checkpoint's groups)"
    old_initial, old_current = olds[0]["initial"], olds[0]["current"] or {}
    if initial is not None and old_initial is not None and k in initial and not _same(initial[k], old_initial.get(k)):
        return new, old_current.get(k, old_initial.get(k))  # the caller restated it
    return old_current.get(k, new), _UNCHANGED


def _source(k: str, group: Mapping[str, Any], olds: List[Mapping[str, Any]], choice: RestoreChoice) -> str:
    """Which of what restore was given changes ``k``: param_groups where it is an override."""
    in_overrides = k in group["overrides"] or any(k in o["overrides"] for o in olds)
    return "param_groups" if in_overrides and ("param_groups" in choice.given or "optimizer" not in choice.given) \
        else "optimizer"


def _change_lines(live: Mapping[str, Any], changes: _Changes) -> List[str]:
    """One log line for a change every group shares, else one per group."""
    if not changes:
        return []

    def text(changed: List[Tuple]) -> str:
        sources = sorted({c[3] for c in changed})
        return (", ".join(f"{k} {_value(old)} -> {_value(new)}" for k, old, new, _ in changed)
                + " (from " + " and ".join(f"{s}=" for s in sources) + " given to restore)")

    name = _short(live["class"])
    texts = [text(c) for _, c in changes]
    if len(changes) == len(live["groups"]) and len(set(texts)) == 1:
        return [f"restore: optimizer {name}: {texts[0]}"]
    return [f"restore: optimizer {name}, param group of {name_list(g['params'])}: {t}" for (g, _), t in zip(changes, texts)]


def _plan_scheduler(old: Optional[Mapping[str, Any]], new: Optional[Mapping[str, Any]], choice: RestoreChoice
                    ) -> Tuple[bool, Optional[Dict[str, Any]], List[str]]:
    """(whether the scheduler starts fresh, the state to load, log lines)."""
    if new is None:
        return (old is not None, None,
                [f"restore: the checkpoint's scheduler {_short(old['class'])} is not used"] if old is not None else [])
    if old is None or old["class"] != new["class"]:
        was = f"the checkpoint's {_short(old['class'])}" if old is not None else "the checkpoint had none"
        return True, None, [f"restore: scheduler {_short(new['class'])} (from scheduler= given to restore) starts from "
                            f"its beginning ({was})"]
    state = dict(old["current"])
    changed = []
    if "scheduler" in choice.given and old.get("initial") is not None and new.get("initial") is not None:
        for k, value in new["current"].items():
            if k in new["initial"] and not _same(new["initial"][k], old["initial"].get(k)):
                state[k] = value
                changed.append(f"{k} {_value(old['current'].get(k))} -> {_value(value)}")
    lines = ([f"restore: scheduler {_short(new['class'])}: {', '.join(changed)} (from scheduler= given to restore); "
              "its step counts load"] if changed else [])
    return False, state, lines


def describe(record: Mapping[str, Any]) -> str:
    """The record's optimizer in one phrase: ``zr.AdamW(lr=0.01, ...)`` or ``SGD(lr=0.1, ...)``."""
    spec = record["spec"]
    if spec["kind"] == "zeroray":
        return f"zr.{spec['class']}(" + ", ".join(f"{k}={_value(v)}" for k, v in spec["fields"].items()) + ")"
    shown = {k: v for k, v in record["defaults"].items() if v not in (None, False)}
    built = f"{_short(record['class'])}(" + ", ".join(f"{k}={_value(v)}" for k, v in shown.items()) + ")"
    return f"zr.elementwise({built})" if spec["kind"] == "elementwise" else built


def _value(v: Any) -> str:
    if isinstance(v, list):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return repr(v) if isinstance(v, str) and not v.startswith("(") else str(v)
