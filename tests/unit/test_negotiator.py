"""Negotiated fetches (fetch/negotiate.py) on a two-rank group whose peer is scripted
(tests/fetch_rig.py): each round all-gathers what every rank needs on the ROUND channel, then
gathers the union; this rank keeps what it asked for and takes part in, and discards, the rest."""
import pytest
import torch

from tests.fetch_rig import PeerGroup, build
from zeroray.comm.group import Channel
from zeroray.errors import CollectiveError
from zeroray.fetch.negotiate import ROUND_SLOTS, Negotiator, decode, encode
from zeroray.fetch.unit import UnitState

ROW = 4 + ROUND_SLOTS


def negotiator():
    rig = build(PeerGroup(world_size=2), persistent=False)
    return rig, Negotiator(rig.group, rig.gatherer, rig.units, rig.waiter)


def test_encode_decode_round_trip_and_disagreement():
    rows = torch.cat([encode(3, 1, False, [0, 2]), encode(3, 1, True, [])])
    assert decode(rows) == ((3, 1), [False, True], [[0, 2], []])
    with pytest.raises(CollectiveError, match=r"out of step.*\[\(3, 1\), \(3, 2\)\]"):
        decode(torch.cat([encode(3, 1, False, []), encode(3, 2, False, [])]))


def test_a_fetch_gathers_the_union_and_keeps_only_what_it_asked_for():
    rig, neg = negotiator()
    rig.group.peer_rows.append(encode(1, 0, False, [1]))  # the peer needs unit 1 in this round
    neg.fetch(1, 0, [0])
    assert rig.group.issued == [(Channel.ROUND, True, ROW), (Channel.ROUND, False, 10), (Channel.ROUND, False, 10)]
    assert [u.state for u in rig.units] == [UnitState.GATHERED, UnitState.SHARDED]  # 1 was taken part in only
    assert torch.equal(rig.units[0].full.view(2, -1)[1], torch.full((10,), 7.0))  # the peer's half arrived
    assert neg.rounds == 1 and rig.group.signals == {"round/1/0/0": "0"}  # announced for blocked peers


def test_finish_answers_rounds_until_every_rank_is_done():
    rig, neg = negotiator()
    rig.group.peer_rows.extend([encode(1, 0, False, [1]), encode(1, 0, False, [0]), encode(1, 0, True, [])])
    neg.finish(1, 0)
    assert neg.rounds == 3
    controls = [i for i in rig.group.issued if i[1]]
    assert len(controls) == 3 and len(rig.group.issued) == 5  # 3 rounds, 2 gathers for the peer
    assert [u.state for u in rig.units] == [UnitState.SHARDED, UnitState.SHARDED]  # nothing kept


def test_join_takes_part_only_in_a_round_a_peer_announced():
    rig, neg = negotiator()
    assert neg.join(1, 0) is False and rig.group.issued == []
    rig.group.signal("round/1/0/0", "1")
    assert neg.join(1, 0) is True
    assert neg.rounds == 1 and rig.group.issued == [(Channel.ROUND, True, ROW)]  # the peer needed nothing
    assert neg.join(1, 0) is False  # round 1 was not announced


def test_a_need_larger_than_a_round_takes_several():
    rig, neg = negotiator()
    neg.fetch(1, 0, [0, 1] * ROUND_SLOTS)  # 2 * ROUND_SLOTS indices: two rounds
    assert neg.rounds == 2


def test_forget_clears_the_steps_announcements():
    rig, neg = negotiator()
    neg.fetch(1, 0, [0])
    neg.fetch(1, 1, [1])
    rig.group.signal("round/2/0/0", "1")  # another call's: kept
    neg.forget(1)
    assert rig.group.signals == {"round/2/0/0": "1"}
