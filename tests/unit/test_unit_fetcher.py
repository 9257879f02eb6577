"""The stage-3 coordinator (fetch/unit_fetcher.py) driven directly, as the engine drives it, over a
one-process group (tests/fetch_rig.py): the first step negotiates and records the trace, the next
follows its schedule with prefetch and frees, a step that leaves the trace negotiates (or, without
independent channels, raises), and the trace is adopted only when the ranks agreed."""
import pytest
import torch

from tests.fetch_rig import PeerGroup, build
from zeroray.comm.group import Channel
from zeroray.errors import ParameterAccessError, UnrecoverableDivergence
from zeroray.fetch.lifecycle import Phase
from zeroray.fetch.unit_fetcher import FetchMode, UnitFetcher
from zeroray.fetch.trace import EventKind
from zeroray.fetch.unit import UnitState

F, E, S, B = EventKind.FORWARD, EventKind.END, EventKind.BACKWARD_START, EventKind.BACKWARD
UNIT_BYTES = 20 * 4  # a Linear(4, 4): 20 fp32 elements


def coordinator(group=None, **settings):
    rig = build(group or PeerGroup(), persistent=False)
    calls = {"negotiate": 0, "before_done": 0}
    options = dict(prefetch=True, prefetch_bytes=UNIT_BYTES, max_live_bytes=None, reuse_distance=0)
    options.update(settings)
    coord = UnitFetcher(rig.units, rig.gatherer, rig.group, rig.waiter, rig.hooked, rig.params,
                        on_negotiate=lambda: calls.__setitem__("negotiate", calls["negotiate"] + 1),
                        before_done_rounds=lambda: calls.__setitem__("before_done", calls["before_done"] + 1),
                        **options)
    return rig, coord, calls


def step(rig, coord, swap=False, agreed=True, seen=None):
    """One step of one micro-batch, as Engine.train_step drives the coordinator; ``seen`` gets
    the units' states as module ``b`` starts."""
    if seen is not None:
        hook = rig.model.b.register_forward_pre_hook(
            lambda m, a: seen.append([u.state for u in rig.units]))  # after the coordinator's own
    coord.begin_step()
    coord.begin_micro_batch(0)
    with torch.autograd.graph.saved_tensors_hooks(coord.pack, coord.unpack):
        loss = rig.model(torch.ones(2, 4), swap=swap).sum()
    coord.begin_backward()
    loss.backward()
    coord.finish_backward()
    coord.end_micro_batch()
    exited, _, _ = coord.status()
    coord.end_step(failed=False, any_exit=bool(exited), agreed=agreed)
    if seen is not None:
        hook.remove()
    return exited


def test_first_step_negotiates_and_records_the_trace():
    rig, coord, calls = coordinator()
    assert coord.schedule is None
    exited = step(rig, coord)
    assert exited == 1.0  # negotiated throughout: counts as leaving the plan, so the trace is adopted
    assert calls == {"negotiate": 1, "before_done": 1}
    assert coord.stats["rounds"] >= 2 and coord.stats["plan_exits"] == 0
    assert coord.schedule is not None
    # backward reads b's weight (for a's output gradient); a's input needs none, so a's weight is not saved
    assert coord.schedule.events == [(F, 0), (E, 0), (F, 1), (E, 1), (S, 0), (B, 1)]
    assert all(u.state is UnitState.SHARDED for u in rig.units)  # every unit freed after the step
    assert coord.phase is Phase.IDLE


def test_second_step_follows_the_trace_with_prefetch_and_frees():
    rig, coord, calls = coordinator()
    step(rig, coord)
    schedule, rounds_before = coord.schedule, [i for i in rig.group.issued if i[0] is Channel.ROUND]
    seen = []
    exited = step(rig, coord, seen=seen)
    assert exited == 0.0 and coord.schedule is schedule  # followed: nothing re-recorded
    assert calls["negotiate"] == 1  # only the first step negotiated
    assert coord.stats["rounds"] == 0 and coord.stats["plan_exits"] == 0
    assert [i for i in rig.group.issued if i[0] is Channel.ROUND] == rounds_before  # no round this step
    # b's unit was prefetched while a ran, and a's was freed at a's END (reuse_distance=0, a
    # window of one unit): as b starts, a is SHARDED and b is gathered.
    assert seen == [[UnitState.SHARDED, UnitState.GATHERED]]
    assert coord.stats["prefetch_hits"] >= 1
    assert coord.stats["peak_gathered_bytes"] == 2 * UNIT_BYTES  # both only in backward
    assert all(u.state is UnitState.SHARDED for u in rig.units)


def test_without_prefetch_every_fetch_is_on_demand():
    rig, coord, _ = coordinator(prefetch=False)
    step(rig, coord)
    seen = []
    step(rig, coord, seen=seen)
    assert coord.stats["prefetch_hits"] == 0 and coord.stats["on_demand"] == coord.stats["fetches"]
    assert seen == [[UnitState.SHARDED, UnitState.GATHERED]]


def test_a_step_that_leaves_the_trace_negotiates_and_is_adopted_when_the_ranks_agree():
    rig, coord, calls = coordinator()
    step(rig, coord)
    step(rig, coord)
    followed = coord.schedule
    exited = step(rig, coord, swap=True)
    assert exited == 1.0
    assert coord.stats["plan_exits"] == 1 and coord.stats["rounds"] >= 1
    assert calls["negotiate"] == 2  # the first step, then the leave
    assert rig.group.signals == {}  # rank 0 cleared the exit and round announcements after the step
    assert coord.schedule is not followed
    assert coord.schedule.events[:4] == [(F, 1), (E, 1), (F, 0), (E, 0)]


def test_a_step_whose_ranks_disagree_keeps_the_old_trace():
    rig, coord, _ = coordinator()
    step(rig, coord)
    followed = coord.schedule
    step(rig, coord, swap=True, agreed=False)
    assert coord.stats["plan_exits"] == 1
    assert coord.schedule is followed


def test_without_independent_channels_leaving_the_plan_raises():
    rig, coord, _ = coordinator(PeerGroup(independent_channels=False))
    step(rig, coord)  # the first step negotiates: world 1 still may (it leaves no plan)
    with pytest.raises(UnrecoverableDivergence, match=r"stage 3: worker 0 left the step's prefetch plan "
                                                      r"\(event 0 \(forward of module 'b'\) differs from the trace\)"):
        step(rig, coord, swap=True)
    assert rig.group.signals["exit/2/0"].startswith("rank 0: event 0")
    assert coord.phase is Phase.IDLE


def test_without_independent_channels_a_peers_exit_raises_while_waiting():
    rig, coord, _ = coordinator(PeerGroup(independent_channels=False))
    step(rig, coord)
    coord.begin_step()
    coord.begin_micro_batch(0)
    rig.group.signal("exit/2/0", "rank 1: event 3 differs")
    with pytest.raises(UnrecoverableDivergence, match=r"stage 3: a peer left the step's prefetch plan "
                                                      r"\(rank 1: event 3 differs\); over NCCL"):
        coord.poll()
    assert coord.phase is Phase.IDLE


def test_reads_are_seen_and_outside_a_step_a_sharded_read_raises():
    rig, coord, _ = coordinator()
    step(rig, coord)
    with pytest.raises(ParameterAccessError, match="'a.weight'.*outside a training step"):
        rig.model.a.weight.sum()
    coord.remove()
    assert type(rig.model.a.weight) is torch.nn.Parameter  # plain again: the read is not seen
    assert rig.waiter.poll is None


@pytest.mark.parametrize("short", ["prefix", "abort"])
def test_a_micro_batch_short_of_the_plan_issues_its_rest_before_the_reductions(short):
    # [Note: the plan's rest before the reductions]: when the engine launches the reductions
    # (before_done_rounds), every gather of the plan is already issued, whether the events were
    # a prefix of the trace (no backward) or the rank's code raised before its forward.
    rig = build(PeerGroup(), persistent=False)
    at_launch = []
    gathers = lambda: sum(1 for channel, _, _ in rig.group.issued if channel is Channel.GATHER)  # noqa: E731
    coord = UnitFetcher(rig.units, rig.gatherer, rig.group, rig.waiter, rig.hooked, rig.params,
                        before_done_rounds=lambda: at_launch.append(gathers()),
                        prefetch=False, prefetch_bytes=UNIT_BYTES, max_live_bytes=None, reuse_distance=0)
    step(rig, coord)  # negotiates, records the trace (without prefetch, backward gathers again)
    before = gathers()
    step(rig, coord)  # follows it: the whole plan
    plan = gathers() - before
    assert plan > 0 and coord.schedule is not None
    before = gathers()
    coord.begin_step()
    coord.begin_micro_batch(0)
    if short == "prefix":
        with torch.autograd.graph.saved_tensors_hooks(coord.pack, coord.unpack):
            rig.model(torch.ones(2, 4))
        coord.begin_backward()
        coord.finish_backward()  # no backward ran: the events are a prefix of the trace
    else:
        coord.abort_micro_batch(0)  # before its forward
    assert at_launch[-1] - before == plan
    coord.end_micro_batch()
    coord.end_step(failed=short == "abort", any_exit=bool(coord.status()[0]), agreed=False)
    assert gathers() - before == plan and coord.phase is Phase.IDLE
