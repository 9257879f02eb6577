"""All-gather of units' parameters from their shards, coalescing small units (C_B).

A group of units is gathered with one collective. One unit gathers straight into its full
buffer, and so does each unit of a group where the backend can gather several tensors into
their own outputs at once (gloo's point-to-point exchange, comm/exchange.py): no staging.
Otherwise (NCCL) several units whose slices are adjacent in the local shard (consecutive in
layout order, the common case) send that slice of the shard as is; the result, an (W,
columns) matrix in a staging buffer, is copied out into each unit's (W, shard_numel) full
buffer. Staging buffers are bounded by ``bucket_bytes`` and reused.

A rank may take part in a gather whose result it does not need (its peers do: a negotiated
step's union, or the rest of a plan it left; see fetch/unit_fetcher.py): a target of ``None`` sends this
rank's shard and discards what arrives, into one scratch buffer.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, List, Optional, Sequence

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.comm.group import Channel, Group, Handle
from zeroray.layout.local_shard import LocalShard


class GatherHandle:
    """An all-gather in flight; ``wait()`` finishes it (copy-out included) exactly once."""

    def __init__(self, units: List[int], handle: Handle, finish: Optional[Callable[[], None]],
                 sent: Sequence[torch.Tensor] = ()) -> None:
        """``sent``: the tensors sent, held until the gather ends (a shard on disk reads each
        into a tensor of its own, which nothing else holds: offload/shard.py)."""
        self.units, self._handle, self._finish = units, handle, finish
        self._sent = list(sent)

    def wait(self) -> None:
        self.wait_for(None)

    def wait_for(self, timeout_s: Optional[float]) -> bool:
        """Block up to ``timeout_s`` (None: until done); True once finished."""
        if self._handle is None:
            return True
        if timeout_s is None:
            self._handle.wait()
        elif not self._handle.wait_for(timeout_s):
            return False
        self._handle = None
        self._sent = []
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    @property
    def done(self) -> bool:
        return self._handle is None


class UnitGatherer:
    MAX_STAGING = 2  # coalesced gathers in flight at once; more wait for the oldest to finish

    def __init__(self, layout: FlatLayout, group: Group, shard: LocalShard, bucket_bytes: int, *,
                 wait: Optional[Callable[[GatherHandle], None]] = None) -> None:
        """``wait``: how a gather is waited for (the engine's polling waiter, comm/waiter.py; by
        default the handle's own wait)."""
        self.layout, self.group, self.shard = layout, group, shard  # compute dtype
        self.bucket_bytes = bucket_bytes
        self._free: List[torch.Tensor] = []
        self._inflight: Deque[GatherHandle] = deque()  # coalesced gathers holding a staging buffer
        self.pool_size = 0
        self._pool_bytes = 0
        self._staging_numel = 0  # grows to the largest coalesced group, which is <= bucket_bytes
        self._discard: Optional[torch.Tensor] = None  # target of gathers this rank does not need
        self.wait: Callable[[GatherHandle], None] = wait if wait is not None else GatherHandle.wait

    def coalesce(self, units: Sequence[int]) -> List[List[int]]:
        """Split units (in issue order) into groups gathered by one collective each."""
        elem = self.shard.element_size()
        groups: List[List[int]] = []
        cur: List[int] = []
        cur_numel = 0
        for u in units:
            n = self.layout.units[u].padded
            if cur and (cur_numel + n) * elem <= self.bucket_bytes and n * elem < self.bucket_bytes:
                cur.append(u)
                cur_numel += n
            else:
                if cur:
                    groups.append(cur)
                cur, cur_numel = [u], n
        if cur:
            groups.append(cur)
        return groups

    def _discard_buffer(self, numel: int) -> torch.Tensor:
        if self._discard is None or self._discard.numel() < numel:
            self._discard = torch.empty(max(u.padded for u in self.layout.units), dtype=self.shard.dtype,
                                        device=self.shard.device)
        return self._discard[:numel]

    def release_discard(self) -> None:
        """Drop the scratch of discarded gathers (allocated only when one happened)."""
        self._discard = None

    def gather(self, units: List[int], fulls: List[Optional[torch.Tensor]], async_op: bool = True,
               channel: Channel = Channel.GATHER) -> GatherHandle:
        """All-gather ``units`` into ``fulls`` (their full buffers, already allocated; None:
        take part, discard the result), in ``channel``'s order ([Note: channels] in group.py)."""
        layout = self.layout
        if len(units) == 1:
            u = layout.units[units[0]]
            inp = self.shard[u.shard_offset:u.shard_offset + u.shard_numel]
            out = fulls[0] if fulls[0] is not None else self._discard_buffer(u.padded)
            return GatherHandle(units, self.group.all_gather(out, inp, async_op=async_op, channel=channel), None, [inp])
        order = sorted(range(len(units)), key=lambda i: units[i])
        us = [layout.units[units[i]] for i in order]
        sends = [self.shard[u.shard_offset:u.shard_offset + u.shard_numel] for u in us]
        pieces = self.group.all_gather_pieces(
            [fulls[i] if fulls[i] is not None else self._discard_buffer(u.padded) for i, u in zip(order, us)],
            sends, async_op=async_op, channel=channel)
        if pieces is not None:  # straight into the full buffers: no staging
            return GatherHandle(units, pieces, None, sends)
        cols = sum(u.shard_numel for u in us)
        contiguous = all(us[i + 1].index == us[i].index + 1 for i in range(len(us) - 1))
        if contiguous and isinstance(self.shard, LocalShard):  # one view, or one copy where the shard is the
            inp = self.shard.read(us[0].shard_offset, us[0].shard_offset + cols)  # arena's rows ([Note: local shard])
        else:  # (a shard on disk read each slice into a tensor of its own already)
            inp = torch.cat(sends)
        while self._inflight and self._inflight[0].done:
            self._inflight.popleft()
        if not self._free and len(self._inflight) >= self.MAX_STAGING:
            self.wait(self._inflight.popleft())  # recycle the oldest staging buffer: the pool stays constant
        staging = self._acquire(cols * self.group.world_size)
        out = staging[:cols * self.group.world_size]
        handle = self.group.all_gather(out, inp, async_op=async_op, channel=channel)
        W = self.group.world_size

        def finish() -> None:
            matrix = out.view(W, cols)
            c = 0
            with torch.no_grad():
                for i, u in zip(order, us):
                    if fulls[i] is not None:
                        fulls[i].view(W, u.shard_numel).copy_(matrix[:, c:c + u.shard_numel])
                    c += u.shard_numel
            self._free.append(staging)

        gathered = GatherHandle(units, handle, finish, [inp])
        self._inflight.append(gathered)
        return gathered

    @property
    def reads_ahead(self) -> bool:
        """Whether ``read_ahead`` does anything (a shard on disk)."""
        return self.shard.reads_ahead

    def read_ahead(self, units: Sequence[int]) -> None:
        """The gathers of ``units`` are coming: let the shard start reading their slices (a shard
        on disk; in memory there is nothing to do)."""
        for index in units:
            u = self.layout.units[index]
            self.shard.prefetch(u.shard_offset, u.shard_offset + u.shard_numel)

    def _acquire(self, numel: int) -> torch.Tensor:
        if self._free:
            buf = self._free.pop()
            if buf.numel() >= numel:
                return buf
            self.pool_size -= 1  # too small for this group: dropped, replaced below
            self._pool_bytes -= buf.numel() * buf.element_size()
        self.pool_size += 1
        self._staging_numel = max(self._staging_numel, numel)
        buf = torch.empty(self._staging_numel, dtype=self.shard.dtype, device=self.shard.device)
        self._pool_bytes += buf.numel() * buf.element_size()
        return buf

    def release_idle(self) -> None:
        """Drop the staging buffers once none is in use. Stages 1-2 gather only to publish an
        update; between the last wait for it and the next publish, the buffers' memory is
        better back in the heap, where the step's activations take it from."""
        if self.pool_size and len(self._free) == self.pool_size:
            self._free.clear()
            self.pool_size = self._pool_bytes = 0

    def buffer_bytes(self) -> int:
        """Bytes of the staging buffers allocated and not dropped (in use or free)."""
        return self._pool_bytes

    def free_staging_bytes(self) -> int:
        """Bytes of the staging buffers back in the free pool (all of them between steps)."""
        return sum(b.numel() * b.element_size() for b in self._free)
