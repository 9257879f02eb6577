"""The collective group: the four collectives zeroray needs, async handles, byte counters.

A ``Group`` is passed in (never a module-level singleton), so tests hand in another.
``TorchGroup`` wraps one torch ``ProcessGroup`` object (gloo on CPU, NCCL on GPU) created
directly from a store, outside ``torch.distributed``'s global world: several groups can
live in one process, and tearing one down (resize, recovery) touches no global state.

[Note: collective order]
Gloo and NCCL match collectives across ranks by the order they are issued in. Every rank
therefore issues the same collectives in the same order: bucket launches follow a static
plan, prefetches follow a trace that every rank verified to be identical, and nothing is
issued from a second thread.

[Note: channels]
Collectives are matched across ranks by issue order *per channel*: parameter gathers
(``GATHER``), gradient reductions (``REDUCE``) and the small agreement rounds of a
negotiated stage-3 step (``ROUND``) each keep their own order. On gloo (the point-to-point
exchange) a channel is a range of message tags, so a rank may interleave its gathers and
its reductions differently from a peer, which a negotiated step needs (see [Note:
negotiated fetch] in fetch/negotiate.py). NCCL has one stream of collectives per group
(``independent_channels`` is False): there a negotiated step reduces after its gathers.
Small all-reduces (grad norm, step status, trace check) use the backend's own collective.

[Note: bytes counted]
``bytes`` is what one rank sends with the ring algorithm: all-gather and reduce-scatter of
a full tensor of N bytes send N·(W-1)/W, all-reduce sends 2·N·(W-1)/W. That is the unit of
the paper's "2Φ vs 3Φ" (docs/architecture.md). Control messages (the step's status
all-reduce, the rounds of a negotiated fetch: a few hundred bytes) are counted apart, under
names starting with ``control_``, and stay out of ``total_bytes``.
"""
from __future__ import annotations

import datetime
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol

import torch

from zeroray.comm.exchange import PeerExchange
from zeroray.errors import CollectiveError

log = logging.getLogger("zeroray")


class RendezvousError(CollectiveError, TimeoutError):
    """Joining a collective group failed: a peer did not join within the rendezvous timeout, or
    died while joining ([Note: rendezvous timeout] in runtime/worker_group/reform.py). The process
    itself is intact."""


class Channel(enum.Enum):
    """Independent orders of collectives; see [Note: channels]."""

    GATHER = 0
    REDUCE = 1
    ROUND = 2


class Handle(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class DoneHandle:
    """A collective that already finished (world size 1, or a synchronous call)."""

    def wait(self) -> None:
        return None

    def wait_for(self, timeout_s: float) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes: int = 0          # ring bytes sent by this rank, see [Note: bytes counted]
    payload_bytes: int = 0  # size of the full tensor the collective produces / consumes


@dataclass
class CommCounter:
    """Per-step communication statistics of one rank."""

    collectives: Dict[str, CollectiveStats] = field(default_factory=dict)
    wait_s: float = 0.0  # time the compute thread spent blocked in wait() (exposed)
    comm_s: float = 0.0  # wall time with at least one collective in flight (total)
    _covered_until: float = 0.0

    def add_busy(self, started: float, done: float) -> None:
        """Count [started, done] into comm_s, minus what earlier collectives already covered.

        Collectives overlap (a prefetch window is several gathers in flight), so summing their
        durations would count the same seconds many times over. Intervals are added when the
        caller waits, which is launch order but for a few prefetches waited out of turn; in
        launch order this is exactly the length of their union, otherwise close to it."""
        self.comm_s += max(0.0, done - max(started, self._covered_until))
        self._covered_until = max(self._covered_until, done)

    def add(self, name: str, payload: int, ring: int) -> None:
        s = self.collectives.setdefault(name, CollectiveStats())
        s.calls += 1
        s.bytes += ring
        s.payload_bytes += payload

    def reset(self) -> None:
        self.collectives.clear()
        self.wait_s = 0.0
        self.comm_s = 0.0
        self._covered_until = 0.0

    @property
    def total_bytes(self) -> int:
        """Model-state bytes sent (params, gradients); control messages excluded."""
        return sum(s.bytes for k, s in self.collectives.items() if not k.startswith("control_"))

    def as_dict(self) -> dict:
        return {"total_bytes": self.total_bytes,
                "collectives": {k: vars(v).copy() for k, v in self.collectives.items()},
                "exposed_s": self.wait_s, "comm_s": self.comm_s}


class _TimedHandle:
    """Wraps a torch Work so the time the caller blocks on it is counted as exposed.

    ``done`` is set by the work's future when the collective completed, which lets a caller
    block for a bounded time (``wait_for``) and do something else in between."""

    __slots__ = ("work", "counter", "done")

    def __init__(self, work, counter: CommCounter, done: Optional[threading.Event]) -> None:
        self.work, self.counter, self.done = work, counter, done

    def wait(self) -> None:
        if self.work is None:
            return
        t0 = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as e:  # a peer died, a connection broke, the timeout passed
            raise CollectiveError(str(e)) from e
        self.counter.wait_s += time.perf_counter() - t0
        self.work = None

    def wait_for(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True (and finished, errors raised) once it completed."""
        if self.work is None:
            return True
        if self.done is not None:
            t0 = time.perf_counter()
            finished = self.done.wait(timeout_s)
            self.counter.wait_s += time.perf_counter() - t0
            if not finished:
                return False
        self.wait()
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class Group:
    """Base: rank, world size, counters. Subclasses implement the collectives.

    ``independent_channels``: see [Note: channels]. ``blocking_waits``: waiting on a handle
    blocks the host until the data arrived (gloo), so a waiter can poll for signals in
    between; on NCCL a wait only orders streams. ``signal``/``signalled`` pass a short string
    to every rank outside the collectives (the rendezvous store): how a rank that leaves the
    step's plan tells the others (see [Note: plan exit] in fetch/unit_fetcher.py)."""

    rank: int
    world_size: int
    counter: CommCounter
    independent_channels: bool = False
    blocking_waits: bool = False

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                   channel: Channel = Channel.GATHER, control: bool = False) -> Handle:
        raise NotImplementedError

    def all_gather_pieces(self, outs: List[torch.Tensor], inps: List[torch.Tensor], async_op: bool = False,
                          channel: Channel = Channel.GATHER) -> Optional[Handle]:
        """Several all-gathers in one handle, each into its own output (``outs[i]``: W rows of
        ``inps[i]``); None where the backend can only gather into one tensor (the caller then
        gathers into a staging buffer and copies out)."""
        return None

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                       scratch: Optional[torch.Tensor] = None, channel: Channel = Channel.REDUCE) -> Handle:
        """``scratch``: optional reused buffer of ``scratch_numel(out.numel())`` elements."""
        raise NotImplementedError

    def signal(self, key: str, value: str) -> None:
        """Publish ``value`` under ``key`` for every rank (world size 1: nobody to tell)."""

    def signalled(self, key: str) -> Optional[str]:
        """The value some rank published under ``key``, or None (without blocking)."""
        return None

    def clear_signal(self, key: str) -> None:
        """Forget ``key`` (one rank does it, once every rank is past reading it)."""

    def scratch_numel(self, out_numel: int) -> int:
        """Working space a reduce-scatter into ``out_numel`` elements needs (0: none)."""
        return 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False,
                   control: bool = False) -> Handle:
        """``control``: a small message about the step, not model state ([Note: bytes counted]).
        Where ``all_reduce_scratch_numel`` is not 0, a sum may also be given ``scratch`` (that
        many elements for ``t``) and a ``channel``, and then goes the group's faster way."""
        raise NotImplementedError

    def all_reduce_scratch_numel(self, numel: int) -> int:
        """Working space with which a sum all-reduce of ``numel`` elements goes faster (0: none)."""
        return 0

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def close(self) -> None:
        pass


class SoloGroup(Group):
    """World size 1: every collective is a copy (or nothing)."""

    # One rank has no peer to match the order of its collectives with, so a stage-3 step
    # whose micro-batches leave the trace negotiates (with itself, at no cost) instead of
    # raising UnrecoverableDivergence, which is about NCCL's single stream ([Note: channels]).
    independent_channels = True

    def __init__(self) -> None:
        self.rank, self.world_size, self.counter = 0, 1, CommCounter()

    def all_gather(self, out, inp, async_op=False, channel=Channel.GATHER, control=False):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DoneHandle()

    def reduce_scatter(self, out, inp, async_op=False, scratch=None, channel=Channel.REDUCE):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DoneHandle()

    def all_reduce(self, t, op="sum", async_op=False, control=False):
        return DoneHandle()

    def broadcast(self, t, src=0):
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TorchGroup(Group):
    """A torch ProcessGroup (gloo or nccl) used through its object API."""

    _OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

    def __init__(self, pg, rank: int, world_size: int, backend: str, *, point_to_point: Optional[bool] = None,
                 store=None, timeout_s: float = 300.0) -> None:
        self.pg, self.rank, self.world_size, self.backend = pg, rank, world_size, backend
        self.store = store  # the rendezvous store: signal() / signalled()
        self.counter = CommCounter()
        # See [Note: gloo point-to-point]; NCCL's own collectives are the fast path on GPUs.
        if point_to_point is None:
            point_to_point = backend == "gloo"
        self.exchange = PeerExchange(pg, rank, world_size, self.counter, timeout_s) if point_to_point else None
        self.independent_channels = self.exchange is not None
        self.blocking_waits = backend == "gloo"

    def signal(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(key, value)

    def signalled(self, key: str) -> Optional[str]:
        if self.store is None or not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def clear_signal(self, key: str) -> None:
        if self.store is not None and self.store.check([key]):
            self.store.delete_key(key)

    def _ring(self, n: int) -> int:
        return n * (self.world_size - 1) // self.world_size

    @staticmethod
    def _launch(start):
        try:
            return start()
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e

    def _done(self, work, async_op: bool) -> Handle:
        if self.backend == "nccl":
            # No completion callback on NCCL: it would run Python on the watchdog's thread for
            # every collective and take the GIL from the thread launching kernels, a host cost
            # paid on each of a step's hundreds of collectives. comm_s stays unmeasured there;
            # exposed time is a stream wait, not host time, on NCCL anyway.
            return self._sync(_TimedHandle(work, self.counter, None), async_op)
        started = time.perf_counter()
        counter = self.counter
        done = threading.Event()

        def finished(_fut) -> None:
            # Runs on the backend's thread when the collective completes.
            counter.add_busy(started, time.perf_counter())
            done.set()

        try:
            work.get_future().add_done_callback(finished)
        except (RuntimeError, AttributeError):  # a backend without futures: total time unknown
            done = None
        return self._sync(_TimedHandle(work, self.counter, done), async_op)

    @staticmethod
    def _sync(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, out, inp, async_op=False, channel=Channel.GATHER, control=False):
        assert out.numel() == inp.numel() * self.world_size, (out.shape, inp.shape)
        self.counter.add("control_all_gather" if control else "all_gather", _nbytes(out), self._ring(_nbytes(out)))
        if self.exchange is not None:
            return self._sync(self.exchange.all_gather(out, inp, channel.value), async_op)
        return self._done(self._launch(lambda: self.pg._allgather_base(out, inp)), async_op)

    def all_gather_pieces(self, outs, inps, async_op=False, channel=Channel.GATHER):
        if self.exchange is None:
            return None
        for out, inp in zip(outs, inps):
            assert out.numel() == inp.numel() * self.world_size, (out.shape, inp.shape)
        total = sum(_nbytes(out) for out in outs)
        self.counter.add("all_gather", total, self._ring(total))
        return self._sync(self.exchange.all_gather_pieces(outs, inps, channel.value), async_op)

    def scratch_numel(self, out_numel: int) -> int:
        return self.exchange.scratch_numel(out_numel) if self.exchange is not None else 0

    def reduce_scatter(self, out, inp, async_op=False, scratch=None, channel=Channel.REDUCE):
        assert inp.numel() == out.numel() * self.world_size, (out.shape, inp.shape)
        import torch.distributed as dist

        self.counter.add("reduce_scatter", _nbytes(inp), self._ring(_nbytes(inp)))
        if self.exchange is not None:
            return self._sync(self.exchange.reduce_scatter(out, inp, scratch, channel.value), async_op)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._done(self._launch(lambda: self.pg._reduce_scatter_base(out, inp, opts)), async_op)

    def all_reduce_scratch_numel(self, numel: int) -> int:
        # [Note: gloo point-to-point] in exchange.py: two ranks exchange their tensors directly.
        return numel if self.exchange is not None and self.world_size == 2 else 0

    def all_reduce(self, t, op="sum", async_op=False, control=False, scratch=None, channel=Channel.REDUCE):
        import torch.distributed as dist

        self.counter.add("control_all_reduce" if control else "all_reduce", _nbytes(t), 2 * self._ring(_nbytes(t)))
        if scratch is not None and op == "sum" and self.all_reduce_scratch_numel(t.numel()):
            return self._sync(self.exchange.all_reduce_pair(t, scratch[:t.numel()], channel.value), async_op)
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, self._OPS[op])
        return self._done(self._launch(lambda: self.pg.allreduce([t], opts)), async_op)

    def broadcast(self, t, src=0):
        import torch.distributed as dist

        self.counter.add("broadcast", _nbytes(t), _nbytes(t) if self.rank == src else 0)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._done(self._launch(lambda: self.pg.broadcast([t], opts)), False)

    def close(self) -> None:
        # Drop the reference; the backend tears its connections down when collected.
        abort = getattr(self.pg, "abort", None)
        if abort is not None and self.backend == "nccl":
            abort()
        if self.exchange is not None:
            alive = self.exchange.close()
            if alive:  # a receive outlived the pg's timeout: should not happen; say so rather than hang
                log.warning("zeroray: exchange watcher thread(s) %s still running after close", alive)
        self.pg = self.exchange = self.store = None


def make_torch_group(backend: str, rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 300.0, store_prefix: str = "zeroray", solo: bool = True,
                     rendezvous_timeout_s: Optional[float] = None) -> Group:
    """Rendezvous through a TCPStore hosted by rank 0 and build the process group object.

    ``timeout_s`` bounds every collective; ``rendezvous_timeout_s`` (default: ``timeout_s``)
    bounds the rendezvous alone, the store and the process group's connections, see [Note:
    rendezvous timeout] in runtime/worker_group/group.py. A rendezvous that does not complete in time raises ``RendezvousError``.
    ``solo=False`` builds a real process group at world size 1 too (the NCCL path exercised
    on one GPU, benchmarks/gpu_check.py), instead of the SoloGroup shortcut."""
    if world_size == 1 and solo:
        return SoloGroup()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    joining = timeout if rendezvous_timeout_s is None else datetime.timedelta(seconds=rendezvous_timeout_s)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is unknown: use 'gloo' (CPU) or 'nccl' (GPU)")
    try:
        tcp = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                            timeout=joining, wait_for_workers=True)
        store = dist.PrefixStore(store_prefix, tcp)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, joining)  # connects to every peer here
            pg._set_default_timeout(timeout)  # the collectives' own (gloo's setter, private in torch 2.13)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout  # NCCL connects lazily, at the first collective
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    except RuntimeError as e:  # a peer did not join in time, or its connection broke while joining
        raise RendezvousError(
            f"rank {rank} of {world_size}: the rendezvous at {master_addr}:{master_port} did not complete within "
            f"{'rendezvous_timeout_s' if rendezvous_timeout_s is not None else 'timeout_s'}={joining.total_seconds():g} s "
            "(a peer did not join, or died while joining): "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
    tcp.set_timeout(timeout)  # the store's reads after the rendezvous (signal()/signalled())
    return TorchGroup(pg, rank, world_size, backend, store=store, timeout_s=timeout_s)
