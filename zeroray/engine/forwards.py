"""Replacing modules' forwards by instance attributes, and putting them back.

Activation checkpointing (engine/activations.py) and the fp32 regions of mixed precision
(engine/precision.py) both wrap ``module.forward`` as an instance attribute, so that module hooks
(the stage-3 coordinator's among them) still run around the wrapper; ``Engine.close`` must
leave each module as it found it, with or without a forward of its own in ``__dict__``.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch


def own_forward(module: torch.nn.Module) -> Tuple[torch.nn.Module, Optional[Callable]]:
    """(module, the forward set on the instance itself, or None): what ``restorer`` puts back."""
    return module, module.__dict__.get("forward")


def restorer(originals: List[Tuple[torch.nn.Module, Optional[Callable]]]) -> Callable[[], None]:
    """A function that puts back every forward recorded by ``own_forward``."""
    def restore() -> None:
        for module, own in originals:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
    return restore
