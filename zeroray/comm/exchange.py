"""Reduce-scatter and all-gather (and two ranks' all-reduce) from gloo's point-to-point sends and receives.

[Note: gloo point-to-point]
Gloo's own ``_reduce_scatter_base`` and ``_allgather_base`` are several times slower than
moving the same bytes with ``send``/``recv`` (figures in benchmarks/README.md, from ``python
benchmarks/collectives.py``). So on gloo both are a direct exchange:

* all-gather: every rank sends its shard to each peer and receives each peer's shard
  straight into that peer's row of the output (of each output, when several units are
  gathered together: one message per unit, so their rows need no staging buffer);
* reduce-scatter: every rank sends row ``p`` of its input to rank ``p`` and receives the
  peers' copies of its own row, the first straight into the output and the others into a
  scratch buffer of W-2 rows (none for two workers), and sums them when they arrived (in the
  order mine + first + the rest: addition is commutative, so the sum is the same bits as
  adding the first to mine);
* all-reduce of two ranks (stage 0's gradient buckets): each sends its whole tensor to the
  other and adds what it received, the same bytes as a ring all-reduce of two.

Each rank sends (W-1)/W of the payload, as the ring does (so [Note: bytes counted] holds).
All sends and receives are posted at once and never block, so there is no ordering among
them to deadlock on; a message is matched by (peer, tag), and the tag is a per-group
sequence number that advances identically on every rank because every rank issues the
collectives in the same order ([Note: collective order]), per channel: each channel has its
own sequence in its own range of tags ([Note: channels] in group.py). The pg's timeout applies to
each receive, so a dead peer raises, as a collective would.

Gloo's point-to-point work has no future and reports completion only through ``wait()``
(which must be called once: a second wait on a receive waits for another message). So each
channel of a group has one *watcher* thread that waits for its exchanges in launch order, runs the
reduce-scatter's sum, stamps the completion time (the total communication time) and sets
an event; the caller's ``wait()`` waits on that event (the exposed time) and re-raises the
watcher's error, e.g. gloo's timeout. Only the launching happens on the caller's thread,
so the order of collectives stays the caller's.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from zeroray.errors import CollectiveError

_TAG_SPAN = 1 << 27  # tags of one channel; channel c uses [c * _TAG_SPAN, (c + 1) * _TAG_SPAN)


class Exchange:
    """Sends and receives in flight; the watcher completes them, ``wait()`` waits for that."""

    __slots__ = ("works", "finish", "counter", "started", "done_at", "error", "event")

    def __init__(self, works: list, finish: Optional[Callable[[], None]], counter, started: float) -> None:
        self.works, self.finish, self.counter, self.started = works, finish, counter, started
        self.done_at: Optional[float] = None
        self.error: Optional[BaseException] = None
        self.event = threading.Event()

    def complete(self) -> None:
        """On the watcher thread: wait for every send and receive, then the local step."""
        try:
            for w in self.works:
                w.wait()
            if self.finish is not None:
                self.finish()
        except BaseException as e:  # handed to the caller's wait()
            self.error = e
        self.done_at = time.perf_counter()
        self.event.set()

    def wait(self) -> None:
        self.wait_for(None)

    def wait_for(self, timeout_s: Optional[float]) -> bool:
        """Block up to ``timeout_s`` (None: until done); True once completed (errors raised)."""
        if self.works is None:
            return True
        t0 = time.perf_counter()
        finished = self.event.wait(timeout_s)
        self.counter.wait_s += time.perf_counter() - t0
        if not finished:
            return False
        self.counter.add_busy(self.started, self.done_at)
        self.works = self.finish = None
        if self.error is not None:
            raise CollectiveError(str(self.error)) from self.error
        return True

    def is_completed(self) -> bool:
        return self.event.is_set()


class PeerExchange:
    """The two collectives over one gloo ProcessGroup's send/recv."""

    def __init__(self, pg, rank: int, world_size: int, counter, timeout_s: float = 300.0) -> None:
        self.pg, self.rank, self.world_size, self.counter = pg, rank, world_size, counter
        self.timeout_s = timeout_s
        self.peers = [r for r in range(world_size) if r != rank]
        self._seq: Dict[int, int] = {}  # channel -> last sequence number
        # One watcher per channel: exchanges complete in launch order within a channel, and a
        # reduction waiting for a late peer must not hold back a gather that already arrived.
        self._pending: Dict[int, "queue.SimpleQueue[Optional[Exchange]]"] = {}
        self._watchers: Dict[int, threading.Thread] = {}

    def _tag(self, channel: int) -> int:
        seq = self._seq[channel] = (self._seq.get(channel, 0) + 1) % _TAG_SPAN
        return channel * _TAG_SPAN + seq

    def _submit(self, exchange: Exchange, channel: int) -> Exchange:
        if channel not in self._watchers:
            # The thread holds the queue only, never the pg: the pg must be destroyed on the
            # thread that closes the group, not on a thread that is exiting.
            self._pending[channel] = queue.SimpleQueue()
            self._watchers[channel] = threading.Thread(target=_watch, args=(self._pending[channel],),
                                                       name=f"zeroray-exchange-{channel}", daemon=True)
            self._watchers[channel].start()
        self._pending[channel].put(exchange)
        return exchange

    def close(self) -> List[str]:
        """Stop the watchers; returns the names of any still running (none, normally).

        Every watcher is told to stop at once and all are joined against one deadline: an
        exchange still in flight ends by the pg's timeout at the latest (its receive times out,
        or fails at once if the peer is gone), so closing takes at most about ``timeout_s``,
        however many channels were busy."""
        for queue_ in self._pending.values():
            queue_.put(None)
        deadline = time.monotonic() + self.timeout_s + 1.0
        for watcher in self._watchers.values():
            watcher.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [w.name for w in self._watchers.values() if w.is_alive()]
        self._watchers.clear()
        self._pending.clear()
        self.pg = None
        return alive

    def _post(self, sends, recvs, tag: int) -> list:
        """Post every send and receive at once (none blocks); a broken connection raises here."""
        try:
            return [self.pg.send([t], p, tag) for t, p in sends] + [self.pg.recv([t], p, tag) for t, p in recvs]
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, channel: int = 0) -> Exchange:
        """``out`` viewed as (W, inp.numel()): row r becomes rank r's ``inp``."""
        started, tag = time.perf_counter(), self._tag(channel)
        rows = out.view(self.world_size, -1)
        works = self._post([(inp, p) for p in self.peers], [(rows[p], p) for p in self.peers], tag)
        if rows[self.rank].data_ptr() != inp.data_ptr():
            rows[self.rank].copy_(inp)
        return self._submit(Exchange(works, None, self.counter, started), channel)

    def all_gather_pieces(self, outs: List[torch.Tensor], inps: List[torch.Tensor], channel: int = 0) -> Exchange:
        """Several all-gathers as one exchange: ``outs[i]`` viewed as (W, inps[i].numel()), row r
        becomes rank r's ``inps[i]``. Each piece is its own message (its own tag), received
        straight into its row: the gather of several units needs no staging buffer."""
        started, works = time.perf_counter(), []
        for out, inp in zip(outs, inps):
            tag = self._tag(channel)
            rows = out.view(self.world_size, -1)
            works += self._post([(inp, p) for p in self.peers], [(rows[p], p) for p in self.peers], tag)
            if rows[self.rank].data_ptr() != inp.data_ptr():
                rows[self.rank].copy_(inp)
        return self._submit(Exchange(works, None, self.counter, started), channel)

    def scratch_numel(self, out_numel: int) -> int:
        return max(self.world_size - 2, 0) * out_numel

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scratch: Optional[torch.Tensor],
                       channel: int = 1) -> Exchange:
        """``inp`` viewed as (W, out.numel()): ``out`` becomes the sum over ranks of row ``rank``."""
        started, tag = time.perf_counter(), self._tag(channel)
        n = out.numel()
        rows = inp.view(self.world_size, n)
        if scratch is None:  # callers on the hot path pass a reused buffer
            scratch = torch.empty(self.scratch_numel(n), dtype=inp.dtype, device=inp.device)
        # The first peer's row lands in ``out`` itself: W-2 rows of scratch, not W-1.
        received = [out] + [scratch[i * n:(i + 1) * n] for i in range(len(self.peers) - 1)]
        works = self._post([(rows[p], p) for p in self.peers], [(received[i], p) for i, p in enumerate(self.peers)],
                           tag)
        mine = rows[self.rank]

        def finish() -> None:
            out.add_(mine)  # = mine + first peer's row, bit for bit (commutative)
            for i in range(1, len(self.peers)):
                out.add_(received[i])

        return self._submit(Exchange(works, finish, self.counter, started), channel)


    def all_reduce_pair(self, t: torch.Tensor, scratch: torch.Tensor, channel: int = 1) -> Exchange:
        """Two ranks: ``t`` becomes the sum of both ranks' ``t``. Each sends its whole ``t`` and
        receives the peer's into ``scratch`` (what a ring all-reduce sends for W=2, as one
        message each way), then adds it: x0 + x1 is the same bits on both ranks (commutative)."""
        assert self.world_size == 2 and scratch.numel() == t.numel(), (self.world_size, scratch.shape, t.shape)
        started, tag = time.perf_counter(), self._tag(channel)
        peer = self.peers[0]
        works = self._post([(t, peer)], [(scratch, peer)], tag)

        def finish() -> None:
            t.add_(scratch)

        return self._submit(Exchange(works, finish, self.counter, started), channel)


def _watch(pending: "queue.SimpleQueue[Optional[Exchange]]") -> None:
    while True:
        exchange = pending.get()
        if exchange is None:
            return
        exchange.complete()
        del exchange  # its works may be the last references to gloo state: drop them here, now
