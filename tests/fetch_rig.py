"""A fetch coordinator's surroundings in one process, for the unit tests of fetch/.

``PeerGroup`` is a real ``Group`` of rank 0 whose peers' side is scripted: a collective's result
lands in the output at ``wait()`` (not before), a gather's peer rows hold ``peer_value``, a
round's peer rows come from ``peer_rows`` (default: the peer needs nothing and is done), and the
store's signals live in a dict. ``issued`` and ``waited`` record what happened, in order.
``build`` lays out a small model, binds it to real units over that group, and hands back
what a coordinator is built from (as the engine does, minus the engine).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Channel, CommCounter, Group
from zeroray.comm.waiter import Waiter
from zeroray.fetch.hooks import HookedModules
from zeroray.fetch.negotiate import encode
from zeroray.fetch.unit import Units
from zeroray.layout.arena import FlatLayout
from zeroray.layout.local_shard import LocalShard


class Net(torch.nn.Module):
    """Two hooked modules; ``swap`` runs them in the other order (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        return self.a(self.b(x)) if swap else self.b(self.a(x))


class Deferred:
    """A collective in flight: its result lands at ``wait()``."""

    def __init__(self, group: "PeerGroup", name: str, run) -> None:
        self.group, self.name, self.run = group, name, run

    def wait(self) -> None:
        if self.run is not None:
            self.run()
            self.run = None
            self.group.waited.append(self.name)

    def wait_for(self, timeout_s: float) -> bool:
        self.wait()
        return True

    def is_completed(self) -> bool:
        return self.run is None


class PeerGroup(Group):
    """Rank 0 of ``world_size``; see the module docstring."""

    def __init__(self, world_size: int = 1, independent_channels: bool = True, peer_value: float = 7.0) -> None:
        self.rank, self.world_size, self.counter = 0, world_size, CommCounter()
        self.independent_channels, self.blocking_waits = independent_channels, True
        self.peer_value = peer_value
        self.peer_rows: Deque[torch.Tensor] = deque()  # the peer's next round rows (encode(...))
        self.issued: List[tuple] = []                  # (channel, control, elements sent)
        self.waited: List[str] = []
        self.signals: Dict[str, str] = {}

    def all_gather(self, out, inp, async_op=False, channel=Channel.GATHER, control=False):
        self.issued.append((channel, control, inp.numel()))
        inp = inp.clone()  # what this rank sent, as it was at the call

        def run() -> None:
            rows = out.view(self.world_size, -1)
            rows[0].copy_(inp)
            for r in range(1, self.world_size):
                if control:
                    peer = self.peer_rows.popleft() if self.peer_rows else encode(
                        int(inp[0]), int(inp[1]), True, ())
                    rows[r].copy_(peer)
                else:
                    rows[r].fill_(self.peer_value)

        handle = Deferred(self, f"{channel.name.lower()}{len(self.issued) - 1}", run)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(self, t, op="sum", async_op=False, control=False):
        return Deferred(self, "all_reduce", lambda: None)

    def signal(self, key: str, value: str) -> None:
        self.signals[key] = value

    def signalled(self, key: str) -> Optional[str]:
        return self.signals.get(key)

    def clear_signal(self, key: str) -> None:
        self.signals.pop(key, None)


@dataclass
class Rig:
    model: Net
    layout: FlatLayout
    group: PeerGroup
    units: Units
    gatherer: UnitGatherer
    waiter: Waiter
    hooked: HookedModules
    params: Dict[str, torch.nn.Parameter]


def build(group: PeerGroup, persistent: bool, bucket_bytes: int = 1) -> Rig:
    """``Net`` bound to units over ``group`` (stage 3 when not ``persistent``). ``bucket_bytes=1``
    gathers each unit with a collective of its own."""
    model = Net()
    layout = FlatLayout.from_module(model, group.world_size, "module")
    params = dict(model.named_parameters())
    initial = torch.zeros(layout.shard_numel)
    for name in layout.param_names:
        piece, lo, hi = layout.param_shard_view(initial, name, group.rank)
        piece.copy_(params[name].detach().reshape(-1)[lo:hi])
    units = Units(layout, torch.float32, torch.device("cpu"), persistent=persistent)
    units.bind(params)
    shard = LocalShard.arena_rows(layout, units.arena, group.rank) if persistent else LocalShard.contiguous(initial)
    gatherer = UnitGatherer(layout, group, shard, bucket_bytes)
    waiter = Waiter(group.blocking_waits)
    gatherer.wait = waiter
    modules = dict(model.named_modules())
    names = list(layout.module_units)
    hooked = HookedModules([modules[n] for n in names], names, [layout.module_units[n] for n in names])
    return Rig(model, layout, group, units, gatherer, waiter, hooked, params)
