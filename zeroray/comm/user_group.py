"""torch.distributed's default group for the user's code on a worker, apart from zeroray's own.

[Note: torch.distributed in user code]
Code a user brings from torch DDP asks torch.distributed for its rank (``dist.get_rank()`` in
``loss_fn``), reduces a metric (``dist.all_reduce``) or synchronises a layer
(``nn.SyncBatchNorm``), all on the default (WORLD) group. zeroray's own collectives run on a
``ProcessGroup`` object it builds outside torch.distributed's global state (group.py), so every
worker also initialises the default group, over the same rendezvous store under a prefix of its
own (``torch.distributed/``): its own gloo connections (and NCCL communicators on GPU workers,
``cpu:gloo,cuda:nccl`` as ``init_process_group`` chooses by default), with its own order of
collectives. A user's all_reduce in ``loss_fn`` therefore never takes the place of a zeroray
gather in [Note: collective order]: each group matches its own collectives across ranks, and
zeroray's in flight (stage 3's prefetched gathers, the buckets' reductions: posted at once and
completed on background threads, [Note: gloo point-to-point]) complete while the user's call
blocks. As under DDP, the user's collectives must themselves be issued by every rank in one
order.

The group is joined after zeroray's (the store exists then) and before the engine builds the
model, so ``model_fn`` sees it too, and it lives exactly as long as zeroray's group: every
re-form (a resize builds new workers; a recovery replaces lost ones, or shrinks to the
survivors, and every worker's ``setup`` joins again) destroys it and initialises it on the new
membership, so its rank and world size are the worker's. At world size 1 (zeroray's
``SoloGroup``) it is a group of one over an in-process store. Joining is bounded by the
rendezvous timeout, its collectives by ``collective_timeout_s``, as zeroray's group is. A
spare's throwaway build (runtime/worker/actor.py ``warm``) never joins: only ``setup`` does.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

from zeroray.comm.group import Group, RendezvousError

STORE_PREFIX = "torch.distributed/"


def join_default_group(group: Group, backend: str, timeout_s: float,
                       rendezvous_timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed's default group with ``group``'s rank and world size, over
    ``group``'s store under a prefix of its own; see [Note: torch.distributed in user code].
    ``backend``: ``"gloo"``, or ``"cpu:gloo,cuda:nccl"`` on GPU workers. A default group still
    there (a setup that failed after joining) is destroyed first. Raises ``RendezvousError`` when
    a peer does not join within ``rendezvous_timeout_s`` (default: ``timeout_s``)."""
    import torch.distributed as dist

    leave_default_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    joining = timeout if rendezvous_timeout_s is None else datetime.timedelta(seconds=rendezvous_timeout_s)
    store = getattr(group, "store", None)
    if group.world_size == 1 or store is None:
        assert group.world_size == 1, "a group of several ranks has a rendezvous store"
        store = dist.HashStore()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(STORE_PREFIX, store), rank=group.rank,
                                world_size=group.world_size, timeout=joining)
    except RuntimeError as e:  # a peer did not connect in time
        leave_default_group()
        raise RendezvousError(
            f"rank {group.rank} of {group.world_size}: torch.distributed's default group did not form within "
            f"{joining.total_seconds():g} s (a peer did not join, or died while joining): "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
    dist.group.WORLD.set_timeout(timeout)  # its collectives' own, as zeroray's group has


def leave_default_group() -> Optional[Any]:
    """Destroy torch.distributed's default group (and any group the user made from it), if there
    is one. Returns the old default ``ProcessGroup`` (None when there was none): the caller
    drops it where its teardown may wait (a broken connection's posted receive) without
    holding anything up, as it closes zeroray's old group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    old = dist.group.WORLD
    dist.destroy_process_group()
    return old

