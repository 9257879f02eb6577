"""Model code ships itself: the user's modules that the workers may not be able to import travel
by value with ``model_fn`` and ``loss_fn``.

[Note: shipping model code]
Ray pickles the worker's spec (``model_fn``, ``loss_fn``, the optimizer spec, ...) with
cloudpickle, which sends a function of ``__main__`` (a script, a notebook) by value, but any
other function or class by reference: "import module ``gpt``, take ``GPT``". A worker on
another node, in a job, or started from another directory often cannot import a module that
lives beside the driver script. So before the first actor starts, ``ship_by_value`` walks what
the spec refers to (functions, their globals and closures, partials, classes and their
methods, config objects, recursively) and registers with
``ray.cloudpickle.register_pickle_by_value`` every module it meets that is the user's own:
not ``__main__`` (already by value), not zeroray, not the standard library, not an installed
distribution and not under a site-packages or interpreter directory. Such a module's
functions and classes then travel as code, and so do the modules they use in turn. Under
``ray job submit --working-dir`` the modules are importable on the workers too; sending them
by value does no harm there. The registration is cloudpickle's own process-wide setting, as
if the user had made the call.
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import sysconfig
import types
from typing import Any, Iterable, Iterator, List, Set

log = logging.getLogger("zeroray")

_MAX_ITEMS = 1000  # a container holding more is data, not code: not walked


def _library_dirs() -> List[str]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return [os.path.realpath(d) + os.sep for d in dirs if d]


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _references(obj: Any) -> Iterator[Any]:
    """What pickling ``obj`` by value would pickle along with it."""
    if isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif isinstance(obj, types.MethodType):
        yield obj.__func__
        yield obj.__self__
    elif isinstance(obj, types.FunctionType):
        names = obj.__globals__
        for name in _code_names(obj.__code__):
            if name in names:
                yield names[name]
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # an empty cell
                pass
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
    elif isinstance(obj, (staticmethod, classmethod)):
        yield obj.__func__
    elif isinstance(obj, type):
        yield from obj.__bases__
        yield from vars(obj).values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        if len(obj) <= _MAX_ITEMS:
            yield from obj
    elif isinstance(obj, dict):
        if len(obj) <= _MAX_ITEMS:
            yield from obj.values()
    elif not isinstance(obj, types.ModuleType):
        yield type(obj)
        try:
            attributes = getattr(obj, "__dict__", None)
        except Exception:  # noqa: BLE001 - a proxy that refuses: nothing to walk
            attributes = None
        if isinstance(attributes, dict) and len(attributes) <= _MAX_ITEMS:
            yield from attributes.values()


class _Shipper:
    """One walk over the objects of a spec; see [Note: shipping model code]."""

    def __init__(self) -> None:
        self.installed: Set[str] = set(importlib.metadata.packages_distributions())
        self.library_dirs = _library_dirs()
        self.verdicts: dict = {}  # module name -> ships by value
        self.registered: List[str] = []

    def is_users(self, module: types.ModuleType) -> bool:
        """Whether ``module`` is the user's own code that a worker may not be able to import."""
        name = module.__name__
        if name not in self.verdicts:
            top = name.partition(".")[0]
            file = getattr(module, "__file__", None)
            self.verdicts[name] = bool(
                file and name != "__main__" and top != "zeroray" and top not in sys.stdlib_module_names
                and top not in sys.builtin_module_names and top not in self.installed
                and not os.path.realpath(file).startswith(tuple(self.library_dirs)))
        return self.verdicts[name]

    def _carries_code(self, obj: Any) -> bool:
        """Data worth looking inside: containers, partials, and instances of the user's classes or
        zeroray's (a config holding a user's callable). A library's object (a framework's hook, a
        loader) is pickled by reference to its class and is not walked: its attributes lead
        anywhere (a whole test session)."""
        kind = type(obj)
        if kind.__module__ in ("builtins", "functools") or isinstance(obj, (functools.partial, types.MethodType)):
            return True
        module = sys.modules.get(kind.__module__)
        return module is not None and (module.__name__.partition(".")[0] == "zeroray" or self.is_users(module))

    def register(self, module: types.ModuleType) -> None:
        import ray.cloudpickle

        if sys.modules.get(module.__name__) is not module:
            # No import made it: it arrived by value itself (a Ray Tune trial whose function was
            # shipped), and cloudpickle sends a module missing from sys.modules by value again.
            return
        top = sys.modules.get(module.__name__.partition(".")[0], module)  # covers its submodules
        if top.__name__ not in self.registered:
            ray.cloudpickle.register_pickle_by_value(top)
            self.registered.append(top.__name__)

    def walk(self, roots: Iterable[Any]) -> None:
        seen: dict = {}  # id -> object: holding them keeps their ids from being reused mid-walk
        stack = list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen[id(obj)] = obj
            if isinstance(obj, types.ModuleType):
                module = obj
            else:
                module = sys.modules.get(getattr(obj, "__module__", None) or "") \
                    if isinstance(obj, (type, types.FunctionType)) else None
            by_value = module is not None and (module.__name__ == "__main__" or self.is_users(module))
            if module is not None and by_value and module.__name__ != "__main__" and \
                    module.__name__.partition(".")[0] not in self.registered:
                self.register(module)
                stack.extend(vars(module).values())  # everything its code may use
            if isinstance(obj, types.ModuleType):
                continue
            if by_value or (module is None and self._carries_code(obj)):  # code by value, or its data
                stack.extend(_references(obj))


def ship_by_value(*roots: Any) -> List[str]:
    """Register by value every module of the user's own that ``roots`` refer to, directly or
    not; returns the top-level names registered. See [Note: shipping model code]."""
    shipper = _Shipper()
    shipper.walk(roots)
    if shipper.registered:
        log.debug("zeroray: model code sent to the workers by value: %s", ", ".join(shipper.registered))
    return shipper.registered
