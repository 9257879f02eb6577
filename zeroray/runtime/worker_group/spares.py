"""Warm spare workers: which one a replacement takes, and which are dead.

A spare is ``(actor, its slot, its warm call's ref)``, kept by the group's ``Placement``
(placement.py) in start order; a slot is ``(placement group, bundle index)`` (None: outside
any). See [Note: replace, don't restart] in worker_group/reform.py for why spares exist and when
they are started, and [Note: spare placement] in placement.py for where.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import ray

Slot = Tuple[Any, int]
Spare = Tuple[Any, Optional[Slot], Any]

# How long a replacement waits for a warm spare to answer a poll before dropping it as dead: a
# live one answers on its control thread within a round trip.
_SPARE_PING_S = 2.0


def take_spare(spares: List[Spare]) -> Optional[Tuple[Spare, bool]]:
    """Remove from ``spares`` the one to put in a lost rank and return it with whether it was
    warm: a warm one first (its warm call returned); else the one started first (further along
    than a new actor would be); None when there is none."""
    if not spares:
        return None
    ready = _warm(spares)
    warm = [i for i, (_, _, ref) in enumerate(spares) if ref in ready]
    return spares.pop(warm[0] if warm else 0), bool(warm)


def drop_dead_spares(spares: List[Spare]) -> Tuple[List[Spare], List[Optional[Slot]]]:
    """The spares to keep, and the slots of those dropped (killed): the ones whose warm call
    failed, whose node is gone, or that no longer answer a poll (their process died after
    warming). Taking one of those would fail the re-form; a cold one is not judged yet."""
    ready = _warm(spares)
    alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")} if ready else set()
    pings = {ref: actor.node_info.remote() for actor, _, ref in spares if ref in ready}
    answered = ray.wait(list(pings.values()), num_returns=len(pings), timeout=_SPARE_PING_S)[0] if pings else []
    dead, kept = [], []
    for actor, slot, ref in spares:
        if ref in ready and (_node_of(ref) not in alive_nodes or pings[ref] not in answered
                             or _node_of(pings[ref]) is None):
            dead.append(slot)
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        else:
            kept.append((actor, slot, ref))
    return kept, dead


def _warm(spares: List[Spare]) -> List[Any]:
    """The warm calls of ``spares`` that have returned (not waited for)."""
    refs = [ref for _, _, ref in spares]
    return ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []


def _node_of(ref: Any) -> Optional[str]:
    """The node a spare's finished call (warm, or a node_info poll) names; None when it raised
    (the spare died)."""
    try:
        out = ray.get(ref)
    except Exception:  # noqa: BLE001 - any failure: the spare is unusable
        return None
    return out["node_id"] if isinstance(out, dict) else out
