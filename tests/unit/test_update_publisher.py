"""The stages 1-2 publish coordinator (fetch/publish.py) driven directly over a two-rank group whose
peer is scripted (tests/fetch_rig.py: a gather's result lands at wait(), the peer's half all 7s):
``publish`` launches one gather per unit, the first read or forward that needs a unit waits for
exactly that unit's gather, ``flush`` (or the end of the micro-batch) waits for the rest, and the
parameters' access class is installed only while a publish is in flight."""
import torch

from tests.fetch_rig import PeerGroup, build
from zeroray.comm.group import Channel
from zeroray.fetch.lifecycle import Phase
from zeroray.fetch.publish import UpdatePublisher
from zeroray.fetch.unit import UnitState

PEER = 7.0


def coordinator(**group_options):
    rig = build(PeerGroup(world_size=2, peer_value=PEER, **group_options), persistent=True)
    return rig, UpdatePublisher(rig.units, rig.gatherer, rig.waiter, rig.hooked, rig.params)


def states(rig):
    return [u.state for u in rig.units]


def peer_half(rig, unit):
    """The peer's rows of ``unit``'s full buffer (the second of two)."""
    return rig.units[unit].full.view(2, -1)[1]


def test_publish_launches_one_gather_per_unit_and_waits_for_none():
    rig, coord = coordinator()
    assert states(rig) == [UnitState.GATHERED, UnitState.GATHERED]  # resident from construction
    coord.publish()
    assert rig.group.issued == [(Channel.GATHER, False, 10), (Channel.GATHER, False, 10)]  # 20 elements / 2 ranks
    assert rig.group.waited == []
    assert states(rig) == [UnitState.GATHERING, UnitState.GATHERING]
    assert not torch.equal(peer_half(rig, 0), torch.full((10,), PEER))  # nothing arrived yet


def test_the_first_read_waits_for_exactly_its_units_gather():
    rig, coord = coordinator()
    coord.publish()
    value = rig.model.b.weight.sum()  # a read outside any hooked module (as in loss_fn)
    assert rig.group.waited == ["gather1"]  # b's gather only
    assert states(rig) == [UnitState.GATHERING, UnitState.GATHERED]
    assert torch.equal(peer_half(rig, 1), torch.full((10,), PEER))
    assert value.item() == rig.units[1].full[:16].sum().item()  # the read saw the gathered values


def test_a_forward_waits_for_its_modules_units_in_a_micro_batch():
    rig, coord = coordinator()
    coord.publish()
    coord.begin_step()
    coord.begin_micro_batch(0)
    seen = []
    rig.model.b.register_forward_pre_hook(lambda m, a: seen.append(list(rig.group.waited)))
    rig.model(torch.ones(1, 4))
    assert seen == [["gather0", "gather1"]]  # a waited for its gather as it started, b for its own
    assert coord.phase is Phase.FORWARD and coord.micro_batch == 0


def test_flush_waits_for_the_rest_and_the_access_class_is_on_only_in_between():
    rig, coord = coordinator()
    seeing = {coord.access.cls}
    plain = {torch.nn.Parameter}
    assert {type(p) for p in rig.model.parameters()} == plain  # no publish yet: reads are not seen
    coord.publish()
    assert {type(p) for p in rig.model.parameters()} == seeing
    rig.model.a.weight.sum()
    assert {type(p) for p in rig.model.parameters()} == seeing  # b's gather is still in flight
    coord.flush()
    assert rig.group.waited == ["gather0", "gather1"]
    assert states(rig) == [UnitState.GATHERED, UnitState.GATHERED]
    assert {type(p) for p in rig.model.parameters()} == plain
    coord.flush()  # nothing in flight: waits for nothing
    assert rig.group.waited == ["gather0", "gather1"]


def test_the_end_of_a_micro_batch_finishes_the_publish():
    rig, coord = coordinator()
    coord.publish()
    coord.begin_step()
    coord.begin_micro_batch(0)
    coord.begin_backward()
    coord.finish_backward()
    coord.end_micro_batch()  # the micro-batch read nothing (a rank with no rows)
    assert states(rig) == [UnitState.GATHERED, UnitState.GATHERED]
    assert type(rig.model.a.weight) is torch.nn.Parameter
    coord.end_step(failed=False, any_exit=False, agreed=True)
    assert coord.status() == (0.0, 0.0, 0.0)


def test_outside_a_step_a_forward_does_not_wait_but_its_reads_do():
    rig, coord = coordinator()
    coord.publish()
    coord.enter(0)  # the pre-hook of a, outside a micro-batch: nothing to do
    assert rig.group.waited == []
    rig.model(torch.ones(1, 4))  # its reads of the weights still wait
    assert rig.group.waited == ["gather0", "gather1"]


def test_remove_unhooks_and_restores_the_plain_class():
    rig, coord = coordinator()
    coord.publish()
    coord.remove()
    assert {type(p) for p in rig.model.parameters()} == {torch.nn.Parameter}
    coord.begin_micro_batch(0)
    rig.model.a(torch.ones(1, 4))  # neither hook nor read reaches the coordinator any more
    assert rig.group.waited == []
