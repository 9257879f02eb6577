"""The hooked modules a coordinator hears from: forward pre- (and post-) hooks reporting a module's index.

The engine picks the modules (one per unit root, each with the units its forward needs) and
hands them over as ``HookedModules``; a coordinator (fetch/unit_fetcher.py, fetch/publish.py)
hooks them with ``ModuleHooks`` and hears ``enter(index)`` before a module runs and, where it
asks for it, ``exit(index)`` after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class HookedModules:
    """``modules[i]`` (named ``names[i]``) needs the units ``needs[i]`` gathered to run its forward."""

    modules: Sequence[torch.nn.Module]
    names: Sequence[str]
    needs: Sequence[Tuple[int, ...]]

    def __post_init__(self) -> None:
        if not len(self.modules) == len(self.names) == len(self.needs):
            raise ValueError(f"HookedModules: {len(self.modules)} modules, {len(self.names)} names and "
                             f"{len(self.needs)} need lists; give one name and one need list per module")
        object.__setattr__(self, "needs", tuple(tuple(n) for n in self.needs))


class ModuleHooks:
    """``enter(index)`` before each hooked module's forward, ``exit(index)`` after it (if given)."""

    def __init__(self, hooked: HookedModules, enter: Callable[[int], None],
                 exit: Optional[Callable[[int], None]] = None) -> None:
        self._index_of = {id(m): i for i, m in enumerate(hooked.modules)}
        self._handles: List = []
        for index, module in enumerate(hooked.modules):
            self._handles.append(module.register_forward_pre_hook(
                lambda module, args, index=index: enter(index)))
            if exit is not None:
                self._handles.append(module.register_forward_hook(
                    lambda module, args, output, index=index: exit(index)))

    def index(self, module: torch.nn.Module) -> Optional[int]:
        """``module``'s index among the hooked modules; None if it is not one of them."""
        return self._index_of.get(id(module))

    def remove(self) -> None:
        """Unhook every module and forget them (the model can go)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._index_of.clear()
