"""The actor boundary is typed: no public ``Worker`` method takes or returns ``Dict[str, Any]``,
and every record that crosses it is a frozen dataclass (runtime/records.py).

The check reads the methods' own annotations (``typing.get_type_hints``, resolved in the
worker's module), walking into every ``List[...]``, ``Optional[...]`` and ``Tuple[...]``, so a
dict hidden in a list of tuples (a layout as ``to_dict()``) is caught as well.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import pytest

from zeroray.runtime import records
from zeroray.runtime.worker.actor import Worker
from zeroray.runtime.worker.sequencer import engine_call


def _untyped_dicts(annotation: Any) -> List[str]:
    """The ``Dict[str, Any]``-like parts of ``annotation`` (a str-keyed dict or mapping of Any)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    found = []
    if origin in (dict, Mapping, typing.Mapping) and (not args or args[1] is Any):
        found.append(repr(annotation))
    if annotation in (dict, Dict):
        found.append(repr(annotation))
    for arg in args:
        found += _untyped_dicts(arg)
    return found


def _public_methods(cls: type) -> Dict[str, Any]:
    """Every public method of ``cls``, its bases' included."""
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def _hints(fn: Any) -> Dict[str, Any]:
    """``fn``'s annotations, resolved in the module it was written in (an engine call's wrapper
    carries its method's annotations and module)."""
    return typing.get_type_hints(fn, globalns=vars(sys.modules[fn.__module__]))


def _violations(cls: type) -> Dict[str, List[str]]:
    out = {}
    for name, fn in _public_methods(cls).items():
        hints = _hints(fn)
        bad = [f"{param}: {d}" for param, hint in hints.items() for d in _untyped_dicts(hint)]
        if bad:
            out[name] = bad
    return out


def test_no_public_worker_method_takes_or_returns_an_untyped_dict():
    methods = _public_methods(Worker)
    assert len(methods) >= 25  # the check saw the actor's methods (engine calls and polls alike)
    for name, fn in methods.items():  # every one is annotated: a missing return type would hide a dict
        assert "return" in _hints(fn), f"Worker.{name} has no return annotation"
    assert _violations(Worker) == {}


def test_the_check_catches_a_dict_crossing_the_boundary():
    class Leaky:
        def report(self) -> Dict[str, Any]: ...

        @engine_call
        def load(self, plan: Optional[Dict[str, Any]] = None) -> int: ...

        def targets(self, t: List[Tuple[Mapping[str, Any], int]]) -> None: ...

        def fine(self, pieces: Dict[str, int]) -> Tuple[Any, ...]: ...

    assert set(_violations(Leaky)) == {"report", "load", "targets"}


def test_every_record_is_a_frozen_dataclass():
    classes = [c for c in vars(records).values()
               if inspect.isclass(c) and c.__module__ == records.__name__ and c is not records.MappingRecord]
    assert len(classes) >= 14
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__


def test_records_users_read_as_dicts_still_read_as_dicts():
    rec = records.RecoveryRecord(cause="WorkerDiedError: x", detected_at=1.0, resumed_at=3.0, seconds=2.0, step=4,
                                 redone_steps=1, num_workers=2, attempts=1, mode="replace", restored_from="memory",
                                 details={"replaced": 1, "restore_s": 0.5})
    assert rec["mode"] == rec.mode == "replace" and rec["replaced"] == 1 and "snapshot_lost" not in rec
    assert rec.get("snapshot_lost", "") == "" and dict(rec)["redone_steps"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.mode = "restart"
    node = records.NodeInfo(rank=0, node_id="n", ip="10.0.0.1", pid=7, host="h")
    assert node["pid"] == 7 and node == {"rank": 0, "node_id": "n", "ip": "10.0.0.1", "pid": 7, "host": "h",
                                         "gpu_ids": (), "placement_group_id": None}
