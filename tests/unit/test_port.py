"""free_port chooses a listening port outside the kernel's ephemeral range, so the outgoing
connections gloo opens between ranks cannot take it between choosing and binding."""
import socket

from zeroray.comm.port import ephemeral_range, free_port, free_ports


def test_port_is_below_the_ephemeral_range_and_bindable():
    lo, hi = ephemeral_range()
    assert lo <= hi
    ports = {free_port() for _ in range(20)}
    if lo > 10000 + 64:  # room below the range (Linux's default starts at 32768)
        assert all(p < lo for p in ports), (ports, lo)
    assert len(ports) > 1  # drawn, not a fixed number two drivers would share
    for port in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_someone_listens_on_is_not_chosen():
    lo, _ = ephemeral_range()
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 20
        assert free_port() not in taken
    finally:
        for s in held:
            s.close()


def test_ports_drawn_together_are_distinct_and_free():
    """A process set runs its rendezvous one after another and keeps each finished store listening
    ([Note: ports drawn together]): a number drawn twice would collide inside the set."""
    ports = free_ports(300)  # more draws than make a repeat likely among ~22,000 numbers
    assert len(set(ports)) == 300
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("", port))

