"""The stage-3 parameter shard in a file of the disk tier, read ahead of the gathers that send it.

[Note: parameter shard on disk]
At stage 3 each rank keeps its slice of every unit, the local parameter shard ([Note: local
shard] in layout/local_shard.py), P bytes per element of Φ/W, and reads it for one thing
only: the all-gather that rebuilds a unit sends the unit's slice (comm/gather.py). With
``offload="disk"`` the shard lives in a file of its own (the compute dtype; offload/tier.py),
and ``DiskShard`` stands where the ``LocalShard`` stands, offering what the gatherer asks of
it: a range ``shard[a:b]`` (or ``read(a, b)``, across units) as a tensor in memory to send.

Read-ahead: the trace that schedules the gathers ([Note: fetch trace] in fetch/trace.py) says
which units the step gathers next, so the coordinator asks for their slices before it issues
them (``prefetch``; ``UnitFetcher._read_ahead`` says how far): each read runs on the
tier's thread pool into a buffer of its own, and the gather that sends it takes the buffer
(waiting, if the read has not ended: the figures' I/O wait). A range never asked for ahead
(a negotiated fetch, the first step, an inference call) is read when the gather sends it.
A buffer lives until the gather that sends it has finished (the collective holds it), so
memory holds the read-ahead window, the gathers in flight and the gathered window, never the
shard.

Writes: the optimizer step writes the update chunk by chunk ([Note: master on disk] in
offload/master.py: the master is on disk too, in every dtype, and ``write`` is the cast into
the parameter memory), each chunk cast into a buffer of its own (the cast a publish makes,
element by element) and written behind the step; the step waits for it as for its other
writes, so the buffers in flight stay a few chunks. Every read starts after the writes
still pending (the next step's first reads run while the last chunks are written), and a
write drops whatever was read ahead (it may be older than the write). So the slice a
gather sends is, bitwise, what the in-memory shard would hold.

What stays in memory: nothing of the shard. Every unit's slice, the root unit's (embeddings,
often the largest) included, is read for each gather of it, as each is gathered from the
peers for each use; keeping one in memory would hold its bytes for the whole step, where
read-ahead hides its read behind the compute before it.

In fp32 the master and the parameter shard hold the same values, so the shard's file is the
master's too: the step reads each chunk of the master from it (``read_into``, after the writes
pending) and its update is the one ``write`` (a copy, not a cast); the stepper has no master
file of its own then (``DiskStepper.shared`` in offload/stepper.py). In bf16/fp16 the master
has its file in the stepper's tier, and ``write`` casts.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch

from zeroray.layout.local_shard import LocalShard
from zeroray.offload.tier import StateFiles

PARAMS = "params"  # the file's key


class DiskShard:
    """This rank's stage-3 parameter shard in a file of its own, in the compute dtype of
    ``values`` (its initial values, written at once); see [Note: parameter shard on disk]."""

    reads_ahead = True  # the coordinator tells it which slices its next gathers send

    def __init__(self, values: torch.Tensor, folder: Optional[str], rank: int,
                 mapped: Optional[Callable[[], ContextManager]] = None) -> None:
        """``mapped``: the context its buffers are allocated in (``MappedBlocks.mapped``, as the
        unit buffers are: [Note: process memory] in memory/process.py); kept as ``mapped``, for
        the disk stepper's own transient tensors ([Note: fresh state off the heap] in
        offload/stepper.py)."""
        if values.device.type != "cpu":
            raise ValueError(f"the parameter shard on disk is read into host memory; it is on {values.device}")
        self.dtype, self.device = values.dtype, values.device
        self.mapped = mapped or contextlib.nullcontext
        self._numel = values.numel()
        self.files = StateFiles(folder, rank, self._numel, [PARAMS], dtype=self.dtype,
                                what="the stage-3 parameter shard")
        self.files.write_now(PARAMS, 0, values)
        self.ahead: Dict[int, Tuple[int, torch.Tensor, Future]] = {}  # start -> (end, buffer, read)
        self.pending: List[Future] = []  # writes, perhaps still running
        self.hits = self.misses = 0      # ranges sent from a read-ahead buffer, or read when sent
        self.wait_seconds = 0.0          # the gathers' waits for reads

    # --- what the gatherer asks of a shard ---------------------------------------------------

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.files.element_bytes

    def breaks(self) -> List[int]:
        return []

    def tensors(self) -> List[torch.Tensor]:
        """The shard's tensors in memory (the memory report): the read-ahead buffers not yet sent."""
        return [buf for _, buf, _ in self.ahead.values()]

    def prefetch(self, a: int, b: int) -> None:
        """Start reading elements [a, b) for a gather to come (nothing if already under way)."""
        if b > a and a not in self.ahead:
            buf = self._empty(b - a)
            self.ahead[a] = (b, buf, self.files.read(PARAMS, a, buf, after=self._pending()))

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a DiskShard is indexed by a slice [a:b] only")
        a, b, _ = index.indices(self._numel)
        return self.read(a, max(a, b))

    def read(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b), a tensor of their own: the buffers read ahead for them when they tile
        the range (several units of one coalesced gather), else read now."""
        if b <= a:
            return torch.empty(0, dtype=self.dtype)
        tiles, pos = [], a
        while pos < b and pos in self.ahead and self.ahead[pos][0] <= b:
            tiles.append(pos)
            pos = self.ahead[pos][0]
        t0 = time.perf_counter()
        if pos == b:
            parts = []
            for start in tiles:
                _, buf, future = self.ahead.pop(start)
                future.result()
                parts.append(buf)
            self.hits += 1
            if len(parts) == 1:
                out = parts[0]
            else:
                with self.mapped():
                    out = torch.cat(parts)
        else:
            self.misses += 1
            out = self._empty(b - a)
            self.files.read(PARAMS, a, out, after=self._pending()).result()
        self.wait_seconds += time.perf_counter() - t0
        return out

    def read_into(self, a: int, out: torch.Tensor, after: Sequence[Future] = ()) -> Future:
        """Start reading elements [a, a + out.numel()) into ``out``, after the writes pending and
        ``after``: in fp32 the optimizer step's reads of the master, whose values these are."""
        return self.files.read(PARAMS, a, out, after=[*self._pending(), *after])

    # --- what the optimizer step and an import write ----------------------------------------

    def write(self, a: int, src: torch.Tensor) -> Future:
        """Cast the 1D ``src`` (the updated fp32 master) over elements [a, a + src.numel()) and
        start writing it; the write's future (the step waits for it before reusing its slots)."""
        self.ahead.clear()  # read before this write: perhaps stale
        with torch.no_grad():
            buf = self._empty(src.numel()).copy_(src)  # a publish's cast
        future = self.files.write(PARAMS, a, buf)
        self.pending = [*self._pending(), future]
        return future

    def copy_(self, src: Union[LocalShard, torch.Tensor]) -> "DiskShard":
        """Load a whole shard (an import), cast as ``write`` casts."""
        values = src.cpu() if isinstance(src, LocalShard) else src.detach().cpu()
        if values.numel() != self._numel:
            raise ValueError(f"a shard of {values.numel()} elements does not fit this one of {self._numel}")
        self.write(0, values.reshape(-1)).result()
        return self

    def cpu(self) -> torch.Tensor:
        """The whole shard, a new tensor in host memory."""
        return self.read(0, self._numel) if self._numel else torch.empty(0, dtype=self.dtype)

    def _empty(self, numel: int) -> torch.Tensor:
        """A buffer whose memory goes back to the OS when it is freed: the buffers come and go
        a few times a step, between the activations, as the unit buffers do."""
        with self.mapped():
            return torch.empty(numel, dtype=self.dtype)

    def _pending(self) -> List[Future]:
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]
        return self.pending

    def drain(self) -> None:
        """Wait for every write in flight and drop what was read ahead."""
        self.ahead.clear()
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def stats(self) -> Dict[str, float]:
        """Totals since the shard was made: bytes read and written, seconds the pool's threads
        spent in I/O, the ranges sent from a read-ahead buffer (hits) or read when sent
        (misses), and the seconds the gathers waited for reads."""
        return {"shard_bytes_read": self.files.bytes_read, "shard_bytes_written": self.files.bytes_written,
                "shard_io_s": self.files.io_seconds, "shard_hits": self.hits, "shard_misses": self.misses,
                "shard_wait_s": self.wait_seconds}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.files.close()
