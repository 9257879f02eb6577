"""The stage-3 schedule is a pure function of the trace and the configuration (fetch/trace.py): what
each position gathers, waits for, prefetches and frees, checked on small made-up traces."""
from zeroray.fetch.trace import EventKind, Schedule, digest

F, E, A, S, B = (EventKind.FORWARD, EventKind.END, EventKind.ACCESS, EventKind.BACKWARD_START,
                 EventKind.BACKWARD)
# Three blocks (modules 0..2, units 0..2) run in order; backward unpacks them in reverse.
TRACE = [(F, 0), (E, 0), (F, 1), (E, 1), (F, 2), (E, 2), (S, 0), (B, 2), (B, 1), (B, 0)]
NEEDS = [(0,), (1,), (2,)]


def one_each(units):
    return [[u] for u in units]


def build(trace=TRACE, *, prefetch=True, prefetch_bytes=1000, max_live_bytes=10_000, reuse_distance=0,
          unit_bytes=(100, 100, 100)):
    return Schedule.build(trace, NEEDS, list(unit_bytes), one_each, prefetch=prefetch,
                          prefetch_bytes=prefetch_bytes, max_live_bytes=max_live_bytes,
                          reuse_distance=reuse_distance)


def gathered_units(schedule):
    return [u for g in schedule.groups for u in g]


def test_a_model_inside_the_prefetch_window_is_gathered_once_and_kept():
    s = build()
    assert gathered_units(s) == [0, 1, 2]  # each unit once: forward prefetches, backward reuses
    assert s.positions[0].on_demand == ((0,),) and s.positions[0].prefetch == ((1,), (2,))
    assert all(not p.release for p in s.positions)


def test_the_window_counts_each_unit_once_so_a_model_as_large_as_it_is_gathered_once():
    # [Note: window of distinct units]: the window is the model's size exactly. Counting every use
    # (forward and backward) made it look 500 bytes long after block 0's forward: block 0 was
    # freed there and gathered again for its backward.
    s = build(prefetch_bytes=300)
    assert gathered_units(s) == [0, 1, 2]
    assert all(not p.release for p in s.positions)
    # one byte less and the model no longer fits: block 0 goes after its forward and comes back
    s = build(prefetch_bytes=299)
    assert gathered_units(s).count(0) == 2 and any(0 in p.release for p in s.positions)


def test_without_prefetch_or_reuse_every_use_gathers_on_demand_and_forward_frees():
    s = build(prefetch=False)
    assert gathered_units(s) == [0, 1, 2, 2, 1, 0]  # the paper's 3 passes: forward, backward
    assert all(not p.prefetch for p in s.positions)
    releases = {i: p.release for i, p in enumerate(s.positions) if p.release}
    assert releases == {1: (0,), 3: (1,), 5: (2,)}  # each block freed at its END


def test_a_small_window_prefetches_one_ahead_and_bounds_what_is_live():
    s = build(prefetch_bytes=100)
    assert s.positions[0].prefetch == ((1,),) and s.positions[2].prefetch == ((2,),)
    s = build(prefetch_bytes=1000, max_live_bytes=150)  # room for one unit beside the running one
    assert all(len(p.prefetch) <= 1 for p in s.positions)


def test_reuse_distance_keeps_a_unit_needed_again_soon():
    # module 0 runs twice, with module 1 in between (a shared layer); backward as before
    trace = [(F, 0), (E, 0), (F, 1), (E, 1), (F, 0), (E, 0), (S, 0), (B, 1), (B, 0)]
    freed_each_time = build(trace, prefetch=False, reuse_distance=0)
    kept = build(trace, prefetch=False, reuse_distance=2)
    assert gathered_units(freed_each_time) == [0, 1, 0, 1, 0]
    assert gathered_units(kept) == [0, 1]  # every next use is within 2 events: kept, never gathered again


def test_a_read_in_loss_fn_is_held_until_backward():
    # unit 2 is read outside any module (an L2 penalty in loss_fn): nothing frees it before backward
    trace = [(F, 0), (E, 0), (A, 2), (S, 0), (B, 2), (B, 0)]
    s = build(trace, prefetch=False)
    assert gathered_units(s) == [0, 2, 0]
    assert all(2 not in p.release for p in s.positions)


def test_the_next_events_units_are_gathered_apart_ahead_of_the_rest():
    # [Note: next event apart]: four blocks of two units each; everything fits in one bucket and
    # in the window. The first event gathers block 0 on demand; the prefetch starts the rest of
    # the model, block 1's units (the next event's) as a gather of their own, then the rest as one.
    trace = [(F, 0), (E, 0), (F, 1), (E, 1), (F, 2), (E, 2), (F, 3), (E, 3), (S, 0)] + \
        [(B, u) for u in range(7, -1, -1)]
    needs = [(0, 1), (2, 3), (4, 5), (6, 7)]
    s = Schedule.build(trace, needs, [100] * 8, lambda units: [list(units)], prefetch=True, prefetch_bytes=10_000,
                       max_live_bytes=100_000, reuse_distance=0)
    assert s.positions[0].on_demand == ((0, 1),)
    assert s.positions[0].prefetch == ((2, 3), (4, 5, 6, 7))
    assert s.groups == [(0, 1), (2, 3), (4, 5, 6, 7)]  # one collective more than coalescing all, no unit twice
    # A prefetch of the next event alone, or of a partial event, is not split.
    one = Schedule.build(trace, needs, [100] * 8, lambda units: [list(units)], prefetch=True, prefetch_bytes=200,
                         max_live_bytes=100_000, reuse_distance=0)
    assert one.positions[0].prefetch == ((2, 3),)


def test_where_the_next_event_is_already_gathered_the_prefetch_is_not_split():
    # A window of 200 bytes sliding over six blocks, blocks 3 and 4 half the size of the others.
    # The first event's prefetch splits (blocks 1 and 2). At block 1's forward the window takes
    # blocks 3 and 4 at once, but the next event (block 2) is gathered already, so its compute
    # overlaps them: one collective, as at every later position.
    trace = [e for m in range(6) for e in ((F, m), (E, m))] + [(S, 0)] + [(B, u) for u in range(5, -1, -1)]
    s = Schedule.build(trace, [(u,) for u in range(6)], [100, 100, 100, 50, 50, 100], lambda units: [list(units)],
                       prefetch=True, prefetch_bytes=200, max_live_bytes=100_000, reuse_distance=0)
    assert s.positions[0].prefetch == ((1,), (2,))
    assert s.positions[2].prefetch == ((3, 4),)
    assert all(len(p.prefetch) <= 1 for p in s.positions[1:])


def test_every_position_knows_its_gathers_and_the_plan_lists_them_in_issue_order():
    s = build(prefetch_bytes=100)
    flat = []
    for i, p in enumerate(s.positions):
        assert s.first_group[i] == len(flat)
        flat += list(p.on_demand) + list(p.prefetch)
    assert flat == s.groups


def test_digest_tells_sequences_apart():
    assert digest(TRACE) == digest(list(TRACE))
    assert digest(TRACE) != digest(TRACE[:-1]) != digest(TRACE[1:])
    assert digest([(F, 1), (F, 2)]) != digest([(F, 2), (F, 1)])
    assert 0 <= digest(TRACE) < 2 ** 52  # travels exactly in a float64
