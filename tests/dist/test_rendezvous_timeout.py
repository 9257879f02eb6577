"""The rendezvous has a timeout of its own ([Note: rendezvous timeout] in
zeroray/runtime/worker_group/reform.py): a rank whose peer never joins gets a RendezvousError after
about ``rendezvous_timeout_s`` (not the collective timeout), in its own process, and a group that
did form keeps ``timeout_s`` for its collectives. Two ranks as threads of one process: each
holds its own store client and process group object."""
import socket
import threading
import time

import pytest
import torch

from zeroray.comm.group import RendezvousError, make_torch_group
from zeroray.errors import CollectiveError


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])  # 0 hosts the store; 1 finds no store to connect to
def test_a_peer_that_never_joins_fails_the_rendezvous_quickly(rank):
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank %d of 2: .*rendezvous_timeout_s=1 s" % rank) as info:
        make_torch_group("gloo", rank, 2, "127.0.0.1", _free_port(), timeout_s=300.0, rendezvous_timeout_s=1.0)
    took = time.monotonic() - t0
    print(f"\n  rank {rank} alone: RendezvousError after {took:.1f} s: {str(info.value)[:160]}")
    assert isinstance(info.value, CollectiveError) and took < 10, took  # the collective timeout is 300 s


def test_the_formed_group_keeps_the_collective_timeout():
    port, groups = _free_port(), {}

    def join(rank):
        groups[rank] = make_torch_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=4.0, rendezvous_timeout_s=1.0)
    peer = threading.Thread(target=join, args=(1,))
    peer.start()
    join(0)
    peer.join()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as info:  # rank 1 never calls it: rank 0 waits out the collective timeout
        groups[0].all_reduce(torch.ones(3), control=True)
    took = time.monotonic() - t0
    print(f"\n  a collective alone: {type(info.value).__name__} after {took:.1f} s")
    assert not isinstance(info.value, RendezvousError)
    assert 3.5 < took < 30, took  # timeout_s=4, not rendezvous_timeout_s=1
    for g in groups.values():
        g.close()
