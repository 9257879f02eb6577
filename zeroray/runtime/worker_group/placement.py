"""Where a worker group's actors run: the placement groups and their bundles, the actors, the spares.

[Note: spare placement]
A spare must never stand in the way of the group it serves: a resize places its new group
next to the old one, and a bundle a spare holds is room the new group lacks (chaos seed 0 with
two spares: 2 workers and 2 spares on a 6-CPU cluster left 2 CPUs for a group of 3, and the
resize raised PlacementError). So a spare holds a placement group of one bundle, its own, which
``release_spares`` removes (the resize does so first, and starts spares again for the new group
once the old one is gone, or for the old one when the resize did not happen). A spare that takes
a lost rank takes its placement group along, and the lost worker's slot goes to the next spare;
so in a group with spares every rank, too, holds a placement group of one bundle, or the slot
a swap leaves in a shared group could not be released. The placement strategy still decides
where: the group places all its bundles in one placement group with the strategy, reads where
they landed, removes it and places one placement group per bundle on those nodes (Ray's soft
node hint: where a node has no room by then, Ray places the bundle elsewhere; without spares the
shared placement group stays, so a STRICT strategy is strict only without spares). Spares are
placed after the group is placed and built, so they queue behind it for resources.

[Note: given placement group]
``ScalingConfig(placement_group=pg, placement_bundles=...)`` places the workers in bundles of a
placement group made elsewhere, a Ray Tune trial's (zeroray/tune/), so that they use the
resources reserved for the trial and nothing outside them: rank r's actor goes into bundle
``placement_bundles[r]``, through the same slots every other path uses (a replacement takes the
lost rank's bundle, a restart after a failure the same bundles again). The group never removes
that placement group (it is not in ``_pgs``; its owner removes it), and two things that need
room beside the group are refused with a ValueError: spares (each holds a placement group of
its own, outside the given one) and a resize (the new group is placed next to the old one;
the Controller's resize, controller/resize.py, says to save and restore into resources of the
new size instead).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zeroray.config import ScalingConfig
from zeroray.runtime.failures import PlacementError
from zeroray.runtime.records import WorkerSpec
from zeroray.runtime.worker.actor import CONCURRENCY_GROUPS, ENGINE_THREADS, Worker
from zeroray.runtime.worker_group.spares import Slot, Spare, drop_dead_spares, take_spare


def ensure_ray(scaling: ScalingConfig) -> None:
    """Start a local embedded Ray when none is running, sized so the workers fit (oversubscribed)."""
    if ray.is_initialized():
        return
    import os

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    cpus = max(os.cpu_count() or 1, 8, int(scaling.num_workers * scaling.cpus_per_worker + 0.999))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING, configure_logging=True)


def _single(bundle: Dict[str, float], node_id: Optional[str]) -> Any:
    """A placement group of one bundle, on node ``node_id`` where it has room (a hint)."""
    return placement_group([dict(bundle)], strategy="STRICT_PACK", _soft_target_node_id=node_id)


def _wait_placed(pgs: Sequence[Any], deadline: float) -> None:
    """Wait until every placement group in ``pgs`` is placed; PlacementError at ``deadline``."""
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    if len(ready) < len(refs):
        raise PlacementError("not placed in time")


def kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def cluster_offer() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    return (f"the cluster has CPU {total.get('CPU', 0):g} (free {free.get('CPU', 0):g}), "
            f"GPU {total.get('GPU', 0):g} (free {free.get('GPU', 0):g}) on {len(ray.nodes())} node(s)")


@dataclass(frozen=True)
class Replacement:
    """A worker for a lost rank (``Placement.replacement``): ``imported`` is its warm call, which
    has returned once it imported what setup imports (a spare's warm-up, or a new actor's
    imports); ``spare``: it was a spare, ``warm``: one whose warm-up had finished."""

    actor: Any
    imported: Any
    spare: bool = False
    warm: bool = False


class Placement:
    """Where one worker group's actors run, and the only writer of it: the placement groups held,
    each rank's slot (a bundle of one of them), the spares and their slots ([Note: spare
    placement]). The group (group.py) holds the actors by rank; this holds where they are."""

    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, spares: int) -> None:
        self.scaling = scaling
        self.pg = None  # the one placement group of every rank's bundle, when the ranks share one
        self.slots: List[Optional[Slot]] = []  # per rank: its slot; None: outside any placement group
        self.spares: List[Spare] = []  # warm actors, each (actor, its slot, its warm call), in start order
        self._spare_count = spares  # how many spares to keep
        # [Note: spare placement]: with spares, every rank and spare holds a placement group of
        # one bundle, so that a spare's reservation is released on its own.
        self._singles = spares > 0
        self._pgs: List[Any] = []  # every placement group held here (removed by close)
        self._freed: List[Optional[Slot]] = []  # the slots a replacement freed, until restock
        self._closed = False
        self._spec = spec  # what a spare warms up for
        self._threads = scaling.threads_per_worker or max(1, int(scaling.cpus_per_worker))
        self._actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Worker)  # once: every actor, spares too
        self._bundle = {"CPU": scaling.cpus_per_worker}
        if scaling.use_gpu:
            self._bundle["GPU"] = 1

    def reserve(self, count: int) -> None:
        """Place ``count`` bundles, one per rank, with the scaling's strategy, waited for up to
        placement_timeout_s: one placement group of ``count`` bundles, or with spares one of a
        bundle each, on the nodes the strategy chose ([Note: spare placement]); or take the given
        placement group's bundles ([Note: given placement group]). Raises PlacementError."""
        scaling, bundle = self.scaling, self._bundle
        if scaling.placement_group is not None:
            self.slots = self._given_bundles(count)
            return
        deadline = time.monotonic() + scaling.placement_timeout_s
        gang = placement_group([dict(bundle) for _ in range(count)], strategy=scaling.placement_strategy)
        pgs = [gang]
        try:
            _wait_placed(pgs, deadline)
            if not self._singles:
                self.pg, self._pgs = gang, [gang]
                self.slots = [(gang, i) for i in range(count)]
                return
            nodes = ray.util.placement_group_table(gang)["bundles_to_node_id"]
            remove_placement_group(gang)
            pgs = [_single(bundle, nodes.get(i)) for i in range(count)]
            _wait_placed(pgs, deadline)
        except PlacementError:
            for pg in pgs:
                remove_placement_group(pg)
            wanted = ", ".join(f"{k} {v * count:g}" for k, v in bundle.items())
            raise PlacementError(
                f"could not place {count} worker(s) of {bundle} each ({wanted} in all, strategy "
                f"{scaling.placement_strategy}) within placement_timeout_s={scaling.placement_timeout_s:g}: "
                f"{cluster_offer()}. Ask for fewer workers (ScalingConfig.num_workers), fewer CPUs per worker "
                "(cpus_per_worker), or add nodes.") from None
        self._pgs = list(pgs)
        self.slots = [(pg, 0) for pg in pgs]

    def _given_bundles(self, count: int) -> List[Slot]:
        """The slots of the first ``count`` bundles ScalingConfig names in a placement group made
        elsewhere, checked and waited for; this group neither owns nor removes it."""
        scaling = self.scaling
        pg = scaling.placement_group
        indices = scaling.placement_bundles or tuple(range(scaling.num_workers))
        if self._singles:
            raise ValueError("FailureConfig(spares=...) needs placement groups of zeroray's own (each spare holds one), "
                             "and ScalingConfig(placement_group=...) places every worker in a given one: "
                             "use spares=0 there")
        specs = pg.bundle_specs
        for i in indices[:count]:
            have = specs[i] if i < len(specs) else None
            if have is None or any(have.get(k, 0) < v for k, v in self._bundle.items()):
                raise ValueError(f"ScalingConfig(placement_bundles={indices}): bundle {i} of the given placement group "
                                 f"is {have} (its bundles: {specs}), but a worker needs {self._bundle}; name bundles "
                                 "that hold cpus_per_worker CPUs (and a GPU with use_gpu)")
        try:
            _wait_placed([pg], time.monotonic() + scaling.placement_timeout_s)
        except PlacementError:
            raise PlacementError(f"the given placement group was not placed within placement_timeout_s="
                                 f"{scaling.placement_timeout_s:g}: {cluster_offer()}") from None
        return [(pg, i) for i in indices[:count]]

    def new_actor(self, rank: int) -> Any:
        """A worker actor for ``rank``, in the rank's slot."""
        return self._actor(rank, self.slots[rank])

    def _actor(self, rank: int, slot: Optional[Slot]) -> Any:
        """A worker actor in ``slot`` (a placement group's bundle), or outside any (None); rank -1: a spare."""
        scaling = self.scaling
        strategy = "DEFAULT" if slot is None else PlacementGroupSchedulingStrategy(
            placement_group=slot[0], placement_group_bundle_index=slot[1])
        return self._actor_cls.options(
            num_cpus=scaling.cpus_per_worker, num_gpus=1 if scaling.use_gpu else 0,
            scheduling_strategy=strategy, max_concurrency=ENGINE_THREADS, max_restarts=0,
            name=None).remote(rank, len(self.slots), self._threads, scaling.use_gpu)

    # --- spares ([Note: spare placement]; which one a replacement takes: spares.py) ------------

    def start_spares(self) -> None:
        """Start spares up to the count kept, each in a placement group of its own ([Note: spare
        placement]); neither the placement nor the warm-up is waited for. None once closed."""
        if self._closed:
            return
        for _ in range(self._spare_count - len(self.spares)):
            self._add_spare(None)

    def release_spares(self) -> None:
        """Kill the spares and remove their placement groups, so that what they held is free (a
        resize places its new group next to this one); ``start_spares`` brings them back."""
        spares, self.spares = self.spares, []
        for actor, slot, _ in spares:
            kill(actor)
            self._release(slot)

    def spares_warm(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` for every spare to be started and warm; whether they are."""
        refs = [ref for _, _, ref in self.spares]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return len(ready) == len(refs)

    def drop_dead_spares(self) -> None:
        """Before a replacement: drop the spares that died (spares.py); their slots are freed."""
        self.spares, dead = drop_dead_spares(self.spares)
        self._freed += dead

    def replacement(self, rank: int, spec: WorkerSpec) -> Replacement:
        """A worker for lost rank ``rank`` ([Note: replace, don't restart] in reform.py): a spare,
        which takes its own slot along (the rank's old slot is freed), or else a new actor in the
        rank's slot (where Ray places the bundle again if its node died)."""
        taken = take_spare(self.spares)
        if taken is None:
            actor = self.new_actor(rank)
            return Replacement(actor, actor.warm.remote(spec))
        (actor, slot, warm_call), warm = taken
        self._freed.append(self.slots[rank])
        self.slots[rank] = slot
        return Replacement(actor, warm_call, spare=True, warm=warm)

    def restock(self) -> None:
        """After a replacement, its re-form done or failed: spares again in the slots it freed, up
        to the count kept (not sooner: they would slow the re-form), the other slots released."""
        freed, self._freed = self._freed, []
        keep = max(0, self._spare_count - len(self.spares)) if not self._closed else 0
        for slot in freed[:keep]:
            self._add_spare(slot)
        for slot in freed[keep:]:
            self._release(slot)

    def _add_spare(self, slot: Optional[Slot]) -> None:
        """Start a spare in ``slot`` (None: in a new placement group of its own) and have it load
        what a build imports; not waited for."""
        if slot is None:
            pg = _single(self._bundle, None)
            self._pgs.append(pg)
            slot = (pg, 0)
        actor = self._actor(-1, slot)
        self.spares.append((actor, slot, actor.warm.remote(self._spec)))

    # --- releasing ---------------------------------------------------------------------------

    def keep_only(self, ranks: Sequence[int]) -> None:
        """A group shrunk to ``ranks`` ([Note: shrink in memory] in reform.py): the other ranks'
        slots are released (a bundle of a shared placement group stays reserved, empty)."""
        for rank, slot in enumerate(self.slots):
            if rank not in ranks:
                self._release(slot)
        self.slots = [self.slots[r] for r in ranks]

    def _release(self, slot: Optional[Slot]) -> None:
        """Remove ``slot``'s placement group, when it is one of a bundle of its own (a spare's)."""
        if slot is not None and slot[0] is not self.pg and slot[0] in self._pgs:
            self._pgs.remove(slot[0])
            try:
                remove_placement_group(slot[0])
            except Exception:  # noqa: BLE001 - already removed
                pass

    def close(self) -> None:
        """Kill the spares and remove every placement group held (no call is waited for)."""
        self._closed = True
        for actor, _, _ in self.spares:
            kill(actor)
        self.spares = []
        pgs, self._pgs, self.pg = self._pgs, [], None
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
