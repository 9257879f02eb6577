"""The whole-parameter optimizer's state on disk: one scratch file per rank, one region per
parameter and state key, read in for that parameter's update and written back after it.

[Note: whole-parameter state on disk]
With ``offload="disk"`` and an optimizer that sees each parameter whole ([Note: whole-parameter
optimizer] in engine/shaped_optim.py), the state of the parameters a rank steps has shapes of
its own (Adafactor's row and column factors, Muon's momentum), so it cannot live in the flat
tier's per-element files (offload/tier.py). It lives in one scratch file per rank instead,
unlinked once open as those are, where every state tensor of one or more dimensions has a
region of its own, ``(parameter, key) -> (byte offset, shape, dtype)``. The 0-dim tensors and
numbers (a ``step``) stay in the optimizer's ``state`` in memory: a few bytes a parameter.

The optimizer steps its parameters a chunk at a time ([Note: whole-parameter exchange] in
engine/param_exchange.py); for each chunk it ``fetch``es the state of the chunk's parameters
(reads on the tier's threads, started before the chunk before it steps), installs it
(``take``), steps, and ``put``s it back: the writes are left running, and a later read of the
same region waits for them. So memory holds about two chunks' state, never the rank's.

Regions are made when a state tensor first goes out, because the optimizer makes its state
lazily and only then are its shapes known: the file grows by ``posix_fallocate``, so a file
system without room fails the step that first needs the room (``OffloadError``, as an I/O error
later does: continue from the last checkpoint), where the flat tier, whose state is per element
and known ahead, fails when the engine is built. A tensor whose shape or dtype changed gets a
new region. The bytes go out and come back as they were, so every update computes, bit for
bit, what it computes with the state in memory.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zeroray.offload.tier import counted_io, offload_error, read_exactly, write_all

ALIGN = 64  # bytes: each region starts on a cache line


@dataclass(frozen=True)
class Region:
    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty(0, dtype=self.dtype).element_size()


def spilled(value: Any) -> bool:
    """Whether a state value goes to the file (a tensor of one or more dimensions)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ParamStateFile:
    """This rank's whole-parameter optimizer state in a scratch file under ``parent`` (None: the
    system's temporary directory); see [Note: whole-parameter state on disk]."""

    def __init__(self, parent: Optional[str], rank: int, threads: int = 2) -> None:
        parent = parent if parent is not None else tempfile.gettempdir()
        try:
            self.folder = tempfile.mkdtemp(prefix=f"zeroray-offload-rank{rank}-", dir=parent)
            path = os.path.join(self.folder, "param_state.bin")
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)  # scratch: nothing is left behind however the worker ends
            os.rmdir(self.folder)
        except OSError as error:
            raise offload_error(parent, "making this worker's scratch file", error) from error
        self._finalizer = weakref.finalize(self, _close_fd, self.fd)
        self.regions: Dict[Tuple[str, str], Region] = {}
        self.held: Dict[str, List[str]] = {}  # parameter -> its keys whose values are in the file
        self.end = 0
        self.pending: Dict[str, List[Future]] = {}  # parameter -> its writes, perhaps still running
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroray-offload")
        self.io_lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.io_seconds = self.wait_seconds = 0.0

    def holds(self, name: str) -> bool:
        return bool(self.held.get(name))

    def state_bytes(self) -> int:
        """Bytes of state in the file now (the regions of the keys held)."""
        return sum(self.regions[(n, k)].nbytes for n, keys in self.held.items() for k in keys)

    # --- one chunk of a step -------------------------------------------------------------------

    def fetch(self, names: Sequence[str]) -> Dict[str, Dict[str, Tuple[torch.Tensor, Future]]]:
        """Start reading the state of ``names`` (those with state in the file) into new tensors."""
        out: Dict[str, Dict[str, Tuple[torch.Tensor, Future]]] = {}
        for name in names:
            after = self.pending.get(name, [])  # kept: a read dropped unused must not free a later one of them
            for key in self.held.get(name, []):
                region = self.regions[(name, key)]
                tensor = torch.empty(region.shape, dtype=region.dtype)
                out.setdefault(name, {})[key] = (tensor, self._submit(read_exactly, region.offset, tensor, after))
        return out

    def take(self, fetched: Dict[str, Dict[str, Tuple[torch.Tensor, Future]]]) -> Dict[str, Dict[str, torch.Tensor]]:
        """Wait for what ``fetch`` started: {parameter: {key: tensor}}."""
        t0 = time.perf_counter()
        out = {}
        for name, keys in fetched.items():
            out[name] = {}
            for key, (tensor, future) in keys.items():
                future.result()
                out[name][key] = tensor
        self.wait_seconds += time.perf_counter() - t0
        return out

    def put(self, name: str, state: Dict[str, Any]) -> None:
        """Move ``state``'s tensors of one or more dimensions into the file (writes left running),
        removing them from ``state``, which keeps the rest."""
        keys, writes = [], []
        for key in [k for k, v in state.items() if spilled(v)]:
            value = state.pop(key).detach().contiguous()
            region = self.regions.get((name, key))
            if region is None or region.shape != tuple(value.shape) or region.dtype != value.dtype:
                region = self.regions[(name, key)] = self._allocate(tuple(value.shape), value.dtype)
            # (the reads whose values are used were waited for before this update)
            writes.append(self._submit(write_all, region.offset, value, []))
            keys.append(key)
        self.pending[name] = writes
        self.held[name] = keys

    def read_now(self, name: str) -> Dict[str, torch.Tensor]:
        """The state of ``name`` in the file, read now (an export, an inspection)."""
        return self.take(self.fetch([name])).get(name, {})

    def drop(self) -> None:
        """Forget every parameter's state (an import replaces it); the file's space is reused."""
        self.drain()
        self.held, self.regions, self.end = {}, {}, 0

    # --- the file ------------------------------------------------------------------------------

    def _allocate(self, shape: Tuple[int, ...], dtype: torch.dtype) -> Region:
        region = Region(self.end, shape, dtype)
        nbytes = region.nbytes
        if nbytes:
            try:
                os.posix_fallocate(self.fd, region.offset, nbytes)
            except OSError as error:
                raise offload_error(self.folder, f"making room for {nbytes} bytes of optimizer state", error) from error
        self.end += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return region

    def _submit(self, op, offset: int, tensor: torch.Tensor, after: List[Future]) -> Future:
        return self.pool.submit(self._io, op, offset, tensor, after)

    def _io(self, op, offset: int, tensor: torch.Tensor, after: List[Future]) -> None:
        counted_io(self, op, self.fd, tensor, offset, after, "optimizer state")

    def drain(self) -> None:
        """Wait for every write in flight."""
        pending, self.pending = self.pending, {}
        for futures in pending.values():
            for f in futures:
                f.result()

    def stats(self) -> Dict[str, float]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "io_s": self.io_seconds,
                "wait_s": self.wait_seconds, "file_bytes": self.end, "state_bytes": self.state_bytes()}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True)
            self._finalizer()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
