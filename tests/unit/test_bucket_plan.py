"""The bucket plan (comm/bucket_plan.py, comm/bucket_tuner.py): packing, the planned flush
timeout, "auto" sizing, and the reducer following a plan. Pure, except the last tests, which
run GradBuckets on a one-rank group."""
import logging
import random

import pytest
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.comm.bucket_plan import (AUTO_MAX_BYTES, AUTO_MIN_BYTES, FIRST_BUCKET_BYTES, MODEL_BUCKETS, Cut,
                                      Timeline, auto_capacity, fixed_capacity, pack, simulate)
from zeroray.comm.bucket_tuner import BucketTuner
from zeroray.comm.buckets import GradBuckets, default_unit_order
from zeroray.comm.group import SoloGroup
from zeroray.layout.stage import ReduceMode

MS = 1000  # microseconds


def sizes(buckets):
    return [(b.row_numel, b.cut) for b in buckets]


def timeline(first, done, end=None):
    units = range(len(first))
    return Timeline(dict(zip(units, first)), dict(zip(units, done)), end if end is not None else max(done))


def test_pack_fills_to_capacity_and_ends_after_cuts():
    columns = {0: 5, 1: 3, 2: 7}
    assert sizes(pack([0, 1, 2], columns, 4)) == [(4, Cut.FULL), (4, Cut.FULL), (4, Cut.FULL), (3, Cut.END)]
    # A cut ends the bucket after unit 0; the next bucket starts with unit 1.
    buckets = pack([0, 1, 2], columns, 6, cuts={0})
    assert sizes(buckets) == [(5, Cut.TIMEOUT), (6, Cut.FULL), (4, Cut.END)]
    assert [(p.unit, p.a, p.b, p.off) for p in buckets[1].pieces] == [(1, 0, 3, 0), (2, 0, 3, 3)]
    # A cut where the bucket is full anyway is a full bucket; a cut after the last unit is no cut.
    assert sizes(pack([0, 1], {0: 4, 1: 2}, 4, cuts={0, 1})) == [(4, Cut.FULL), (2, Cut.END)]
    # Plan order, not unit index order; a unit without columns takes no piece.
    buckets = pack([2, 0, 1], {0: 1, 1: 0, 2: 2}, 8)
    assert [(p.unit, p.off) for p in buckets[0].pieces] == [(2, 0), (0, 2)]


def test_a_fixed_plan_starts_with_a_small_bucket_and_is_sized_for_the_model():
    """[Note: first bucket]: the first bucket holds at most ``first`` columns, the rest ``capacity``."""
    columns = {0: 5, 1: 3, 2: 7}
    assert sizes(pack([0, 1, 2], columns, 6, first=2)) == [(2, Cut.FULL), (6, Cut.FULL), (6, Cut.FULL), (1, Cut.END)]
    assert sizes(pack([0, 1, 2], columns, 4, first=9)) == sizes(pack([0, 1, 2], columns, 4))
    # A timeout cut inside the small first bucket still ends it there.
    assert sizes(pack([1, 0, 2], columns, 6, cuts={1}, first=4)) == [(3, Cut.TIMEOUT), (6, Cut.FULL), (6, Cut.END)]
    mib = 2**20
    assert fixed_capacity(16 * mib, 13 * mib) == -(-13 * mib // MODEL_BUCKETS)  # a small model: several buckets
    assert fixed_capacity(16 * mib, 400 * mib) == 16 * mib                      # a large one keeps bucket_bytes
    assert fixed_capacity(16 * mib, 2 * mib) == FIRST_BUCKET_BYTES              # never under 1 MiB
    assert fixed_capacity(64, 2 * mib) == 64                                    # never over bucket_bytes


def test_fixed_buckets_of_a_model_smaller_than_one_bucket_reduce_during_backward():
    """A 4 MiB model with the default 16 MiB buckets: a 1 MiB first bucket, then buckets of an
    eighth of the model (1 MiB floor), launched as their gradients arrive, with the same sums."""
    layout = FlatLayout([(f"m{i}", [(f"m{i}.w", (2**18,))]) for i in range(4)], 1)  # 1 MiB per unit
    target = torch.zeros(layout.full_numel)
    reducer = GradBuckets(layout, SoloGroup(), target, mode=ReduceMode.ALL_REDUCE, bucket_bytes=16 * 2**20,
                          dtype=torch.float32, unit_order=default_unit_order(layout))
    assert [b.row_numel * 4 for b in reducer.buckets] == [2**20] * 4 and reducer.max_inflight == 16
    reducer.begin_backward(accepting=True)
    grads = {n: torch.randn(layout.slots[n].numel) for n in layout.param_names}
    for name in reversed(layout.param_names):
        reducer.add_grad(name, grads[name])
    assert reducer.take_stats()["full"] == 3  # launched during "backward", before finish
    reducer.finish()
    assert torch.equal(target, torch.cat([grads[n] for n in layout.param_names]))


def test_timeout_cuts_where_the_next_gradients_come_too_late():
    # Units complete at 0, 1, 30, 31, 60 ms; a 10 ms timeout cuts after units 1 and 3.
    t = timeline([0, 1 * MS, 29 * MS, 31 * MS, 59 * MS], [0, 1 * MS, 30 * MS, 31 * MS, 60 * MS])
    sim = simulate(range(5), {u: 10 for u in range(5)}, 1000, t, 10 * MS)
    assert sim.cuts == {1, 3}
    assert sim.buckets == ((20, Cut.TIMEOUT), (20, Cut.TIMEOUT), (10, Cut.END))
    # A timeout longer than every gap: one bucket; capacity still splits it.
    assert simulate(range(5), {u: 10 for u in range(5)}, 1000, t, 100 * MS).cuts == frozenset()
    assert simulate(range(5), {u: 10 for u in range(5)}, 25, t, 100 * MS).buckets == (
        (25, Cut.FULL), (25, Cut.END))


def test_timeout_measures_from_the_first_gradient_and_joins_what_arrives_before_the_bucket_is_ready():
    # Unit 0 starts early but completes late (a tied weight); units 1 and 2 complete before it:
    # they join its bucket for free. Unit 3 completes after both the timeout and the bucket's readiness.
    t = timeline([0, 2 * MS, 3 * MS, 50 * MS], [40 * MS, 2 * MS, 3 * MS, 50 * MS])
    assert simulate(range(4), {u: 1 for u in range(4)}, 100, t, 10 * MS).cuts == {2}
    # Each gap below the timeout, but the whole run longer than it: measured from the first.
    t = timeline([0, 6 * MS, 12 * MS], [0, 6 * MS, 12 * MS])
    assert simulate(range(3), {u: 1 for u in range(3)}, 100, t, 10 * MS).cuts == {1}


@pytest.mark.parametrize("seed", range(200))
def test_packing_the_simulated_cuts_gives_the_simulated_buckets(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    order = list(range(n))
    rng.shuffle(order)
    columns = {u: rng.choice([0, 1, 3, 8, 20]) for u in range(n)}
    first = [rng.randint(0, 100 * MS) for _ in range(n)]
    done = [f + rng.choice([0, 0, 500, 20 * MS]) for f in first]
    t = Timeline(dict(enumerate(first)), dict(enumerate(done)), max(done) + 1)
    capacity = rng.choice([1, 5, 16, 1000])
    sim = simulate(order, columns, capacity, t, rng.choice([1, 5 * MS, 30 * MS]))
    assert tuple(sizes(pack(order, columns, capacity, sim.cuts))) == sim.buckets
    # Every column is in exactly one bucket, whatever the cuts.
    assert sum(c for c, _ in sim.buckets) == sum(columns.values())


def test_auto_capacity_moves_to_the_largest_burst():
    # Three bursts of 3, 5 and 2 units of 64 KiB columns arriving 50 ms apart.
    done = [0, 1, 2, 50, 51, 52, 53, 54, 100, 101]
    t = timeline([d * MS for d in done], [d * MS for d in done])
    columns, column_bytes = {u: 1 for u in range(10)}, 64 * 2**10
    largest = 5 * column_bytes
    size = auto_capacity(range(10), columns, t, 10 * MS, 16 * 2**20, column_bytes)
    assert size == 512 * 2**10 and size >= largest  # the power of two above the largest burst
    assert auto_capacity(range(10), columns, t, 10 * MS, 128 * 2**10, column_bytes) == 512 * 2**10  # grows
    # Settled: no move either way; a burst just under half the size is within the margin.
    assert auto_capacity(range(10), columns, t, 10 * MS, 512 * 2**10, column_bytes) == 512 * 2**10
    assert auto_capacity(range(10), columns, t, 10 * MS, 640 * 2**10, 2**10 * 64) == 640 * 2**10
    # Bounds: tiny gradients never go below the minimum, one long burst never above the maximum.
    assert auto_capacity(range(10), columns, t, 10 * MS, 16 * 2**20, 4) == AUTO_MIN_BYTES
    assert auto_capacity(range(10), columns, t, 10**9, 16 * 2**20, 2**30) == AUTO_MAX_BYTES


def test_tuner_is_deterministic_and_logs_size_changes(caplog):
    order, columns = [3, 2, 1, 0], {u: 1000 for u in range(4)}
    summed = []
    for rank_done in ([0, 1, 40, 41], [0, 3, 44, 45]):  # two ranks' timelines, in ms, plan order
        summed.append([d * MS for d in rank_done] * 2 + [50 * MS])
    total = [float(a + b) for a, b in zip(*summed)]
    tuners = [BucketTuner(order, columns, 16, capacity_bytes=16 * 2**20, timeout_ms=10.0, auto=True)
              for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="zeroray"):
        assert all(t.observe(1, t.decode_mean(total, 2)) is None for t in tuners)  # warm-up: not learned
        assert all(t.observe(2, t.decode_mean(total, 2), learn=False) is None for t in tuners)
        plans = [t.observe(2, t.decode_mean(total, 2)) for t in tuners]
    assert plans[0] == plans[1] and plans[0] is not None
    assert plans[0].cuts == {2}  # after the second unit in plan order
    assert plans[0].capacity_bytes == AUTO_MIN_BYTES  # 2 units x 1000 columns x 16 bytes fit in 64 KiB
    assert tuners[0].changes == [(2, 16 * 2**20, AUTO_MIN_BYTES)]
    assert "16 MiB -> 0.0625 MiB" in caplog.text
    assert tuners[0].observe(3, tuners[0].decode_mean(total, 2)) is None  # nothing new: no new plan
    # Without "auto" only the cuts move.
    fixed = BucketTuner(order, columns, 16, capacity_bytes=2**20, timeout_ms=10.0, auto=False)
    fixed.observe(1, fixed.decode_mean(total, 2))
    assert fixed.observe(2, fixed.decode_mean(total, 2)).capacity_bytes == 2**20


def _reducer(bucket_bytes, model_sizes=((3, 5), (7,), (4, 4), (6,))):
    layout = FlatLayout([(f"m{i}", [(f"m{i}.p{j}", (n,)) for j, n in enumerate(shapes)])
                         for i, shapes in enumerate(model_sizes)], 1)
    target = torch.zeros(layout.full_numel)
    reducer = GradBuckets(layout, SoloGroup(), target, mode=ReduceMode.ALL_REDUCE, bucket_bytes=bucket_bytes,
                          dtype=torch.float32, unit_order=default_unit_order(layout))
    return layout, reducer, target


def test_reducer_follows_any_plan_with_the_same_sums():
    layout, reducer, target = _reducer(bucket_bytes=40)
    grads = {n: torch.randn(layout.slots[n].numel) for n in layout.param_names}
    order = list(reversed(layout.param_names))
    plans = [(40, frozenset()), (40, frozenset({3, 1})), (1000, frozenset({2})), (8, frozenset({3}))]
    results = []
    for bucket_bytes, cuts in plans:
        reducer.replan(bucket_bytes, cuts)
        target.zero_()
        reducer.begin_backward(accepting=True)
        for name in order:
            reducer.add_grad(name, grads[name])
        reducer.finish()
        results.append(target.clone())
        stats = reducer.take_stats()
        assert stats["full"] + stats["timeout"] + stats["end"] == len(reducer.buckets)
        if cuts and bucket_bytes == 1000:
            assert stats["timeout"] == 1
    for r in results[1:]:
        assert torch.equal(r, results[0])
    timeline = reducer.last_timeline
    assert set(timeline.done) == {u.index for u in layout.units}
    assert all(0 <= timeline.first[u] <= timeline.done[u] <= timeline.end for u in timeline.done)


def test_a_missing_gradient_never_holds_the_plan():
    """A rank that does not produce a unit's gradients (another branch): every bucket before it
    launches when ready, finish() launches the rest, and the missing unit counts as zero."""
    layout, reducer, target = _reducer(bucket_bytes=1000)
    reducer.replan(1000, frozenset({3, 2, 1}))  # one bucket per unit
    reducer.begin_backward(accepting=True)
    missing = layout.units[1].params
    for name in reversed(layout.param_names):
        if name not in missing:
            reducer.add_grad(name, torch.ones(layout.slots[name].numel))
    # Units 3 and 2 launched by the timeout plan; unit 1's bucket waits, so does unit 0's behind it.
    assert reducer.take_stats()["timeout"] == 2
    reducer.finish()
    unit = layout.units[1]
    assert target[unit.full_offset:unit.full_offset + unit.numel].abs().sum() == 0
    assert target.sum() == layout.numel - unit.numel
    assert reducer.last_timeline.done[1] == reducer.last_timeline.end
    stats = reducer.take_stats()
    assert (stats["full"], stats["timeout"], stats["end"]) == (0, 0, 2) and stats["blocked_ms"] >= 0


def test_auto_without_a_timeout_takes_an_eighth_of_the_backward():
    order, columns = [1, 0], {0: 10, 1: 10}
    tuner = BucketTuner(order, columns, 4, capacity_bytes=16 * 2**20, timeout_ms=None, auto=True)
    assert tuner.timeout_ms is None
    slow = Timeline({1: 0, 0: 300 * MS}, {1: 0, 0: 300 * MS}, 320 * MS)  # a gap of 300 ms in a 320 ms backward
    tuner.observe(1, slow)
    assert tuner.observe(2, slow).cuts == {1} and tuner.timeout_ms == 40.0
    fast = Timeline({1: 0, 0: 3 * MS}, {1: 0, 0: 3 * MS}, 4 * MS)  # the same shape, 80 times faster
    other = BucketTuner(order, columns, 4, capacity_bytes=16 * 2**20, timeout_ms=None, auto=True)
    other.observe(1, fast)
    assert other.observe(2, fast).cuts == {1} and other.timeout_ms == 0.5


def test_reused_buffers_and_missing_gradients_count_as_zero_in_a_scaled_write():
    """[Note: scaled write]: a bucket's buffer is zeroed only in its holes (padding columns) when
    taken, and in the ranges of parameters without a gradient when launched at the end; a
    scaled write replaces whatever the target held. Buffers are reused from the step before,
    full of its gradients, so a range left unzeroed would show here."""
    shapes = ((3, 5), (7,), (4, 4), (6,), (5,))
    layout = FlatLayout([(f"m{i}", [(f"m{i}.p{j}", (n,)) for j, n in enumerate(s)]) for i, s in enumerate(shapes)],
                        3)  # units padded to a multiple of 3: padding columns in the buckets
    assert layout.full_numel > sum(sum(s) for s in shapes)
    target = torch.zeros(layout.full_numel)
    reducer = GradBuckets(layout, SoloGroup(), target, mode=ReduceMode.ALL_REDUCE, bucket_bytes=40,
                          dtype=torch.float32, unit_order=default_unit_order(layout))
    assert len(reducer.buckets) > reducer.max_inflight and reducer.covers_target

    def expected(grads, scale):
        out = torch.zeros(layout.full_numel)
        for name, g in grads.items():
            slot = layout.slots[name]
            start = layout.units[slot.unit].full_offset + slot.offset
            out[start:start + slot.numel] = g * scale
        return out

    order = list(reversed(layout.param_names))
    for step, (present, scale) in enumerate([(order, None), (order[1::2], 0.25), (order[::3], 0.5), ([], 2.0)]):
        grads = {n: torch.randn(layout.slots[n].numel) + 10 for n in present}
        if scale is None:
            target.zero_()
        else:
            target.fill_(float("nan"))  # a scaled write does not read the target
        reducer.begin_backward(accepting=True, write_scaled=scale)
        for name in present:
            reducer.add_grad(name, grads[name])
        reducer.finish()
        assert torch.equal(target, expected(grads, 1.0 if scale is None else scale)), step
    assert reducer.pool_size < len(reducer.buckets)  # buffers were reused across buckets and steps
