"""A TCP port for rank 0's store, chosen by the driver and handed to every rank.

[Note: port outside the ephemeral range]
The port is chosen in one process and bound later in another, so something else can take it
in between. Asking the kernel for port 0 returns a port from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range it draws the local port of every
outgoing connection from, and gloo opens many connections between ranks: a run that chose its
ports up front lost one to a gloo connection of the run before it (EADDRINUSE at rank 0, the
other ranks timing out). A port below that range is never given to an outgoing connection, so
only a listener that picked the very same number could take it.

[Note: ports drawn together]
A process set that runs several rendezvous one after another (the tests' engine tables) draws
their ports up front, and a rank keeps each finished run's store listening until it exits (the
old default group holds the store, and is kept so that its teardown cannot hang the rank). Two
draws of the same number were then a collision inside the set itself: the later rendezvous met
EADDRINUSE at rank 0 while the others timed out (CI, tests/dist/test_sync_batchnorm.py, 21
runs in one set). ``free_ports`` draws numbers that are free now and distinct from each other.
"""
from __future__ import annotations

import random
import socket

_LOWEST = 10000  # below: well-known and registered services more likely to listen


def ephemeral_range() -> tuple:
    """The kernel's ephemeral port range, or the IANA default where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_port(attempts: int = 64) -> int:
    """A port no one listens on now, outside the ephemeral range where one exists below it
    (see [Note: port outside the ephemeral range]); else any free port the kernel gives."""
    lo, _ = ephemeral_range()
    rng = random.Random()  # seeded from the OS: concurrent drivers draw different ports
    if lo - _LOWEST > attempts:
        for _ in range(attempts):
            port = rng.randrange(_LOWEST, lo)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list:
    """``count`` distinct ports, each free now, for rendezvous run one after another in one set of
    processes (see [Note: ports drawn together])."""
    ports: list = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
