"""Stage 3 without a shared plan: every fetch agreed with the other ranks first.

[Note: negotiated fetch]
Collectives only match when every rank issues them in the same order. A step that follows
a verified trace gets that for free (every rank runs the same schedule). A step without one
(the first step, or a step whose ranks took different branches: data-dependent routing, a
mixture of experts) cannot know what the peers will need. So each fetch becomes a *round*
on the ``ROUND`` channel: every rank contributes what it needs now (a few unit indices) or
that it is *done* with the micro-batch; one small all-gather tells everyone what everyone
needs; then every rank takes part in gathering the union, keeping what it asked for and
discarding the rest. A rank that is done keeps answering rounds until every rank is done.
Rounds carry the step and micro-batch, which must agree (a protocol check).

A rank still computing, blocked in a wait on something a peer owes it (a gradient
reduction), may be exactly what that peer's round waits for. So the first rank to start
round ``k`` of a micro-batch announces it (``round/<call>/<micro-batch>/<k>`` in the group's
store), and a blocked rank that sees it takes part with an empty need (``join``; the waiter
polls, comm/waiter.py): rounds never wait on a rank that is waiting on them.

This is the paper's parameter-server analogy made collective: a unit is fetched from its
owners exactly when some rank needs it, and a rank with different data still trains
exactly what it would train alone. It costs one small all-gather per fetch and no
prefetch, which is why a step with a verified trace follows the schedule instead.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from zeroray.comm.gather import UnitGatherer
from zeroray.comm.group import Channel, Group
from zeroray.errors import CollectiveError
from zeroray.fetch.unit import Units, UnitState

ROUND_SLOTS = 32        # unit indices one rank can ask for in one round
_NEED, _DONE = 1, 2


def encode(call: int, micro_batch: int, done: bool, need: Sequence[int]) -> torch.Tensor:
    """One rank's contribution to a round: [call, micro-batch, kind, count, units..., -1 ...]."""
    assert len(need) <= ROUND_SLOTS
    row = torch.full((4 + ROUND_SLOTS,), -1, dtype=torch.int64)
    row[:4] = torch.tensor([call, micro_batch, _DONE if done else _NEED, len(need)])
    if need:
        row[4:4 + len(need)] = torch.tensor(list(need), dtype=torch.int64)
    return row


def decode(rows: torch.Tensor) -> Tuple[Tuple[int, int], List[bool], List[List[int]]]:
    """((call, micro-batch) every rank agrees on, done per rank, need per rank); raises on disagreement."""
    table = rows.view(-1, 4 + ROUND_SLOTS).tolist()
    keys = {(r[0], r[1]) for r in table}
    if len(keys) != 1:
        raise CollectiveError(f"stage-3 fetch rounds out of step: the ranks are at (step call, micro-batch) "
                              f"{[(r[0], r[1]) for r in table]}; the worker group cannot continue")
    done = [r[2] == _DONE for r in table]
    need = [r[4:4 + r[3]] for r in table]
    return keys.pop(), done, need


class Negotiator:
    """Runs rounds over ``group``: see [Note: negotiated fetch]."""

    def __init__(self, group: Group, gatherer: UnitGatherer, units: Units, wait: Callable) -> None:
        self.group, self.gatherer, self.units, self.wait = group, gatherer, units, wait
        self.rounds = 0                 # rounds this step (all micro-batches)
        self._next: Dict[Tuple[int, int], int] = {}  # (call, micro-batch) -> this rank's next round
        self.in_round = False

    def fetch(self, call: int, micro_batch: int, need: Sequence[int]) -> None:
        """Gather the units in ``need`` (not yet gathered here), in rounds with the other ranks."""
        need = list(need)
        while need:
            chunk, need = need[:ROUND_SLOTS], need[ROUND_SLOTS:]
            self._round(call, micro_batch, False, chunk)

    def finish(self, call: int, micro_batch: int) -> None:
        """This rank is done with the micro-batch: answer rounds until every rank is."""
        while not self._round(call, micro_batch, True, ()):
            pass

    def join(self, call: int, micro_batch: int) -> bool:
        """Take part, needing nothing, in a round a peer started; True if there was one."""
        if self.in_round or self.group.signalled(self._key(call, micro_batch, self._next.get(
                (call, micro_batch), 0))) is None:
            return False
        self._round(call, micro_batch, False, ())
        return True

    def forget(self, call: int) -> None:
        """After the step: drop the announcements of its rounds (one rank does it)."""
        for (c, m), count in list(self._next.items()):
            if c == call:
                if self.group.rank == 0:
                    for k in range(count):
                        self.group.clear_signal(self._key(c, m, k))
                del self._next[(c, m)]

    @staticmethod
    def _key(call: int, micro_batch: int, k: int) -> str:
        return f"round/{call}/{micro_batch}/{k}"

    def _round(self, call: int, micro_batch: int, done: bool, need: Sequence[int]) -> bool:
        """One round; True when every rank said it is done."""
        k = self._next.get((call, micro_batch), 0)
        self._next[(call, micro_batch)] = k + 1
        key = self._key(call, micro_batch, k)
        if self.group.signalled(key) is None:
            self.group.signal(key, str(self.group.rank))
        self.rounds += 1
        self.in_round = True
        try:
            return self._exchange(call, micro_batch, done, need)
        finally:
            self.in_round = False

    def _exchange(self, call: int, micro_batch: int, done: bool, need: Sequence[int]) -> bool:
        mine = encode(call, micro_batch, done, need).to(self.gatherer.shard.device)
        rows = torch.empty(mine.numel() * self.group.world_size, dtype=mine.dtype, device=mine.device)
        self.wait(self.group.all_gather(rows, mine, async_op=True, channel=Channel.ROUND, control=True))
        _, all_done, needs = decode(rows.cpu())
        union = sorted({u for n in needs for u in n})
        wanted = set(need)
        handles = []
        for group_units in self.gatherer.coalesce(union):
            fulls = []
            for u in group_units:
                unit = self.units[u]
                if u in wanted and unit.state is UnitState.SHARDED:
                    fulls.append(self.units.alloc(u))
                else:
                    fulls.append(None)  # a peer's need (or already here): take part, discard
            handle = self.gatherer.gather(group_units, fulls, channel=Channel.ROUND)
            for u, full in zip(group_units, fulls):
                if full is not None:
                    self.units[u].start_gather(handle)
            handles.append(handle)
        for handle in handles:
            self.wait(handle)
            for u in handle.units:
                if self.units[u].handle is handle:
                    self.units[u].gathered()
        return all(all_done)
