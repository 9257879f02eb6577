"""Which rank owns each trainable parameter whole: the map the whole-parameter optimizer steps by
and the checkpoints, resizes and snapshots route its state by.

[Note: parameter owners]
An optimizer that is not element-wise (Adafactor, Muon, LAMB, ...) steps every parameter whole,
with its real shape ([Note: whole-parameter optimizer] in engine/shaped_optim.py). At stages 1-3
each trainable parameter has one *owner* rank that holds all of that parameter's optimizer state
and steps it, as torch's ZeroRedundancyOptimizer and Distributed Muon do. The owners are
balanced by element count: the parameters, largest first (ties in layout order), each go to the
rank with the fewest elements so far (ties to the lowest rank). It is a pure function of the
layout (its parameter names, shapes and world size), so every rank computes the same map, and
so does whoever reads a checkpoint at another world size: the rank that holds a parameter's
state after a restore, a resize or a recovery is its owner under the *new* layout. Stage 0's
state layout has world size 1 (engine/storage.py), so there rank 0 of it, every rank, owns all.

The balance is only as good as the sizes allow: one parameter larger than Φ/W (an embedding)
makes its owner hold more than its share. ``imbalance`` says by how much (the memory report
shows it).
"""
from __future__ import annotations

import heapq
from typing import Container, Dict, List, Tuple

from zeroray.layout.arena import FlatLayout


def param_owners(layout: FlatLayout) -> Dict[str, int]:
    """The owner rank of every trainable parameter (canonical names, in layout order); see
    [Note: parameter owners]."""
    names = layout.param_names
    order = sorted(range(len(names)), key=lambda i: (-layout.slots[names[i]].numel, i))
    loads = [(0, rank) for rank in range(layout.world_size)]  # a heap of (elements, rank)
    owner: Dict[str, int] = {}
    for i in order:
        load, rank = heapq.heappop(loads)
        owner[names[i]] = rank
        heapq.heappush(loads, (load + layout.slots[names[i]].numel, rank))
    return {name: owner[name] for name in names}


def owned_by(layout: FlatLayout, rank: int) -> List[str]:
    """The parameters ``rank`` owns under ``layout``, in layout order."""
    return [name for name, owner in param_owners(layout).items() if owner == rank]


def owner_loads(layout: FlatLayout) -> List[int]:
    """Elements owned by each rank."""
    loads = [0] * layout.world_size
    for name, owner in param_owners(layout).items():
        loads[owner] += layout.slots[name].numel
    return loads


def imbalance(layout: FlatLayout) -> float:
    """The most elements any rank owns over the mean (1.0: perfectly balanced)."""
    loads = owner_loads(layout)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


# --- the keys an owner's state is exported under -----------------------------------------------

# A state tensor of parameter ``name`` under ``key`` is exported as "param_state/<name>/<key>", a
# number (a Python int, float or bool the optimizer keeps) as a 0-dim tensor under
# "param_number/<name>/<key>". Only the owner exports a parameter's keys, so the ranks' files
# hold different keys; checkpoints record which rank's file holds each (checkpoint/manifest.py).
STATE_PREFIX = "param_state/"
NUMBER_PREFIX = "param_number/"


def owned_key(name: str, key: str, number: bool = False) -> str:
    return f"{NUMBER_PREFIX if number else STATE_PREFIX}{name}/{key}"


def is_owned_key(key: str) -> bool:
    """Whether an exported tensor is one parameter's whole-parameter optimizer state."""
    return key.startswith(STATE_PREFIX) or key.startswith(NUMBER_PREFIX)


def split_owned_key(key: str, names: Container[str]) -> Tuple[str, str, bool]:
    """(parameter, state key, is a number) of an owned key; ``names``: the layout's parameter
    names (a set), the longest that fits winning (a name may hold "/", a state key too)."""
    number = key.startswith(NUMBER_PREFIX)
    rest = key[len(NUMBER_PREFIX if number else STATE_PREFIX):]
    cuts = [i for i, c in enumerate(rest) if c == "/" and rest[:i] in names]
    if not cuts:
        raise ValueError(f"optimizer state {key!r} names no parameter of this model")
    return rest[:cuts[-1]], rest[cuts[-1] + 1:], number
