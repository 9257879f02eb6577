"""The bucket plan: which pieces of which units each gradient bucket holds. Pure: no tensors.

``pack`` cuts the units, in the order their gradients are expected, into buckets of at most
``capacity`` columns, ending a bucket early after the units in ``cuts``. ``simulate`` replays
the paper's rule "send a buffer when it is full or when a timeout expired since its first
tensor" on a measured arrival timeline, which yields those cuts, and ``auto_capacity`` reads
from the same replay the size the buckets should have.

[Note: bucket timeout]
A rank cannot launch a bucket on its own clock: collectives are matched by the order they
are issued in ([Note: collective order] in group.py), so if one rank sent bucket b after T ms
with what had arrived while a peer waited for b to fill, the two would reduce different
contents as if they were the same. So the timeout is *planned* from something every rank
agrees on, a measured step:

1. Each rank records, per unit, when the first and when the last of its gradients reached
   the buckets in the step's (last reduced) backward, in whole microseconds since the first
   gradient; a unit this rank did not complete counts as arriving when ``finish`` ran.
2. The step's status all-reduce (engine/engine.py) carries these numbers: every rank gets their sum
   over ranks, integers summed exactly, so the mean timeline is the same, bit for bit, on
   every rank. Steps that failed, stage-3 steps that negotiated fetches (the ranks ran
   different modules, [Note: negotiated fetch] in fetch/negotiate.py) and the first step
   (allocators warming up; stage 3 negotiates it) teach nothing; the plan stays as it was.
3. The tuner (bucket_tuner.py) smooths the timeline over steps and ``simulate`` replays the
   rule on it at unit granularity: walking the units in plan order, a bucket is cut before
   the unit whose gradients would complete more than T after the bucket's first gradient
   arrived (and later than the bucket is ready anyway). The set of units after which a
   bucket ends, and the capacity, are the *plan*: every rank computes it from the same numbers
   with the same code, so every rank packs the same buckets and launches them in the same
   order.
4. With the plan, a bucket cut by the timeout is launched when its last unit's gradients
   arrived: with the content the timeout would have sent, and no later than it would have.

Why whole units: in a reduce-scatter a bucket's column range takes a slice of every rank's
row of the unit, i.e. parameters from W places of it ([Note: gradient buckets] in
buckets.py), so no column range is complete before (nearly) the whole unit is; a cut inside
a unit would launch nothing earlier. The unit is the smallest part whose gradients complete
together.

The plan never makes a rank wait for a gradient it will not produce: a cut only ends a
bucket earlier; a bucket still launches when its own gradients have arrived, and ``finish``
launches the rest (missing gradients count as zero), as without a plan. A plan changes
only between steps, on every rank at the same step, and changes the grouping of the
gradients, never their values: each element is still the sum over ranks of the same numbers.

[Note: first bucket]
A fixed plan (no timeout, not "auto") is cut the way torch DDP cuts its buckets: the first
bucket in gradient order holds at most ``FIRST_BUCKET_BYTES`` (DDP's 1 MiB), so that a
reduction is under way after the first gradients of backward, not after the first
``bucket_bytes`` of them; and no bucket holds more than a ``MODEL_BUCKETS``-th of the model's
gradients (never less than ``FIRST_BUCKET_BYTES``), so that a model smaller than one bucket
(the default 16 MiB holds a whole small model) still reduces in several buckets while
backward runs, instead of one after it, with the whole reduction exposed. Larger models keep
``bucket_bytes``. Both only regroup the gradients: every element is the same sum.

[Note: bucket sizing]
``ZeroConfig(bucket_bytes="auto")`` reads the size from the same replay. With no bound on
the size, the timeout alone groups the units into *bursts*: runs of gradients that complete
within T of their bucket's first one. A bucket larger than the largest burst only ever times
out, and its buffers hold memory for nothing (the paper: "if large buffers often time out,
shrink them"); one smaller than a burst cuts it into full buckets that could have gone as
one message: it fragments. So the size moves to the largest burst, rounded up to a power of
two, within [``AUTO_MIN_BYTES``, ``AUTO_MAX_BYTES``]: up at once (a burst is being cut), down
only when the largest burst fits in ``SHRINK_MARGIN`` of half the size (so a burst near a
power of two does not flip the size every step). Without a given timeout, "auto" takes an
eighth (``AUTO_BUCKETS_PER_BACKWARD`` in bucket_tuner.py) of the measured backward, first
gradient to ``finish``, as T: how long a gradient may usefully wait scales with how long
backward takes, which differs by orders of magnitude between a CPU and a GPU, so no fixed
number fits both; this way no gradient waits for company longer than an eighth of the
backward. The gathers' coalescing bound (gather.py) stays at the configured default:
gathers are issued by the prefetch schedule, not by gradient arrival, so the timeline says
nothing about them, and stage 3 builds its schedule once from the verified trace with that
bound ([Note: fetch trace] in fetch/trace.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

FIRST_BUCKET_BYTES = 2**20
MODEL_BUCKETS = 8
AUTO_MIN_BYTES = 64 * 2**10
AUTO_MAX_BYTES = 256 * 2**20
SHRINK_MARGIN = 0.8


class Cut(enum.Enum):
    """Why a bucket ends where it does (and what launches it in a step that follows the plan)."""

    FULL = "full"        # it reached the capacity
    TIMEOUT = "timeout"  # the planned timeout: the next unit's gradients come too late
    END = "end"          # the last bucket of the backward


@dataclass
class Piece:
    unit: int
    a: int    # first column of the unit's (rows, row_numel) view
    b: int    # end column
    off: int  # first column inside the bucket's rows


@dataclass
class BucketSpec:
    pieces: List[Piece] = field(default_factory=list)
    row_numel: int = 0
    cut: Cut = Cut.END


def pack(order: Sequence[int], columns: Dict[int, int], capacity: int,
         cuts: AbstractSet[int] = frozenset(), first: Optional[int] = None) -> List[BucketSpec]:
    """Units in ``order`` (``columns[u]`` each) into buckets of at most ``capacity`` columns, the
    first one of at most ``first`` ([Note: first bucket]); a bucket also ends after every unit in
    ``cuts`` ([Note: bucket timeout])."""
    assert capacity >= 1
    buckets: List[BucketSpec] = []
    bucket = BucketSpec()
    cut_here = False  # the previous unit ends a bucket (decided when more columns follow)

    def size() -> int:  # the capacity of the bucket being filled
        return max(min(first, capacity), 1) if first is not None and not buckets else capacity

    for u in order:
        n, a = columns[u], 0
        if n and cut_here and 0 < bucket.row_numel < size():
            bucket.cut = Cut.TIMEOUT
            buckets.append(bucket)
            bucket = BucketSpec()
        while a < n:
            if bucket.row_numel >= size():
                bucket.cut = Cut.FULL
                buckets.append(bucket)
                bucket = BucketSpec()
            b = min(n, a + size() - bucket.row_numel)
            bucket.pieces.append(Piece(u, a, b, bucket.row_numel))
            bucket.row_numel += b - a
            a = b
        if n:
            cut_here = u in cuts
    if bucket.pieces:
        buckets.append(bucket)
    return buckets


@dataclass(frozen=True)
class Timeline:
    """When each unit's gradients arrived in one backward, in microseconds since the first one
    (a unit not completed: ``end``), and when ``finish`` ran (``end``)."""

    first: Dict[int, int]
    done: Dict[int, int]
    end: int


@dataclass(frozen=True)
class Simulation:
    cuts: frozenset                   # units after which the timeout ends a bucket
    buckets: Tuple[Tuple[int, Cut], ...]  # (columns, why it ends), in plan order


def simulate(order: Sequence[int], columns: Dict[int, int], capacity: int, timeline: Timeline,
             timeout_us: int) -> Simulation:
    """Replay "launch when full, or ``timeout_us`` after the first tensor" on ``timeline``."""
    cuts = set()
    out: List[Tuple[int, Cut]] = []
    fill, opened, ready, prev = 0, 0, 0, None
    for u in order:
        n = columns[u]
        if n == 0:
            continue
        if fill == capacity:
            out.append((fill, Cut.FULL))
            fill = 0
        done = timeline.done[u]
        if fill and done > max(ready, opened + timeout_us):
            cuts.add(prev)
            out.append((fill, Cut.TIMEOUT))
            fill = 0
        a = 0
        while a < n:
            if fill == capacity:
                out.append((fill, Cut.FULL))
                fill = 0
            if fill == 0:
                opened, ready = timeline.first[u], done
            ready = max(ready, done)
            take = min(n - a, capacity - fill)
            fill += take
            a += take
        prev = u
    if fill:
        out.append((fill, Cut.END))
    return Simulation(frozenset(cuts), tuple(out))


def fixed_capacity(bucket_bytes: int, model_bytes: int) -> int:
    """The size of a fixed plan's buckets, in bytes: ``bucket_bytes``, but no more than a
    ``MODEL_BUCKETS``-th of the model's gradients (nor under ``FIRST_BUCKET_BYTES``), so that a
    model smaller than one bucket still reduces in several, during backward ([Note: first bucket])."""
    return min(bucket_bytes, max(FIRST_BUCKET_BYTES, -(-model_bytes // MODEL_BUCKETS)))


def auto_capacity(order: Sequence[int], columns: Dict[int, int], timeline: Timeline, timeout_us: int,
                  current_bytes: int, column_bytes: int) -> int:
    """The bucket size, in bytes, that neither waits nor fragments ([Note: bucket sizing])."""
    unbounded = max(AUTO_MAX_BYTES // column_bytes, 1)
    bursts = simulate(order, columns, unbounded, timeline, timeout_us).buckets
    largest = max((n for n, _ in bursts), default=0) * column_bytes
    target = AUTO_MIN_BYTES
    while target < largest and target < AUTO_MAX_BYTES:
        target *= 2
    if target > current_bytes:
        return target
    if target < current_bytes and largest <= SHRINK_MARGIN * current_bytes / 2:
        return target
    return current_bytes
