"""The disk tier: one scratch file per optimizer state tensor (and the fp32 master in mixed
precision, and at stage 3 the parameter shard: offload/shard.py), read and written by a thread pool.

Each worker makes a folder of its own under ``offload_dir`` and, in it, one file per state key
(``exp_avg``, ``exp_avg_sq``, ..., and ``master``: [Note: master on disk] in offload/master.py)
of ``numel`` elements (fp32; the parameter shard's file in the compute dtype), addressed by the
offset in the rank's flat master: element ``i`` of a piece at master ``[start, end)`` is at byte
``element_bytes * (start + i)``. It unlinks the files (and the folder) as soon as they are open, so that no scratch
outlives the process, however it ends (closed, killed by Ray, SIGKILL). Splitting the optimizer's pieces ([Note: unused parameters] in engine/flat_pieces.py)
never moves state between files. The files are allocated in full when the tier is made
(``posix_fallocate``), so that a directory that cannot hold them fails there, before any
training state exists that a failure could lose ([Note: disk offload] in offload/stepper.py).
Reads and writes are ``preadv``/``pwrite`` straight between the files and the caller's tensors,
on a small thread pool (the calls release the GIL); each returns a future.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

import torch

FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
ELEMENT_BYTES = 4  # the state is fp32, as the master is


class OffloadError(RuntimeError):
    """The disk tier cannot hold or move the optimizer state (an unwritable or full ``offload_dir``,
    an I/O error). ``errno``: the operating system's error number, when there is one."""

    def __init__(self, message: str, error_number: Optional[int] = None) -> None:
        super().__init__(message)
        self.errno = error_number


def offload_error(folder: str, what: str, error: OSError) -> OffloadError:
    """``error`` from ``what`` under ``folder`` as an OffloadError that says what to do."""
    if error.errno in FULL_ERRNOS:
        try:
            stats = os.statvfs(folder)
            free = f"{stats.f_bavail * stats.f_frsize / 2**20:.1f} MiB free there"
        except OSError:
            free = "its free space unknown"
        return OffloadError(
            f"offload_dir {folder!r} is full ({error.strerror}, {free}) while {what}: give ZeroConfig.offload_dir "
            "a file system with room for the optimizer state (its size is in the error of the allocation, or "
            "8 bytes per parameter element for Adam, 12 in bf16/fp16 with the fp32 master; at stage 3, with the "
            "parameter shard, 12 in fp32 and 14 in bf16/fp16; divided by the number of workers at stages 1-3)",
            error.errno)
    return OffloadError(
        f"offload_dir {folder!r} cannot be used ({error.strerror or error}) while {what}: point "
        "ZeroConfig.offload_dir at a writable directory, or set offload=None to keep the optimizer state in memory",
        error.errno)


class StateFiles:
    """This rank's state files: ``keys`` each of ``numel`` fp32 elements, made in a scratch folder
    of its own under ``parent`` (None: the system's temporary directory) and unlinked with it once
    open; ``close`` (or the process's end) frees their space."""

    def __init__(self, parent: Optional[str], rank: int, numel: int, keys: Sequence[str],
                 threads: int = 2, dtype: torch.dtype = torch.float32, what: str = "optimizer state") -> None:
        """``dtype``: the files' elements (fp32: state and master; the compute dtype: the stage-3
        parameter shard); ``what``: what they hold, for the error of the allocation."""
        parent = parent if parent is not None else tempfile.gettempdir()
        self.numel, self.keys, self.dtype = numel, list(keys), dtype
        self.element_bytes = torch.empty(0, dtype=dtype).element_size()
        try:
            self.folder = tempfile.mkdtemp(prefix=f"zeroray-offload-rank{rank}-", dir=parent)
        except OSError as error:
            raise offload_error(parent, "making this worker's scratch folder", error) from error
        self.fds: Dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, self.fds, self.folder)
        nbytes = numel * self.element_bytes
        for key in self.keys:
            path = os.path.join(self.folder, f"{key}.f32")
            try:
                self.fds[key] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                if nbytes:
                    os.posix_fallocate(self.fds[key], 0, nbytes)
            except OSError as error:
                self.close()
                raise offload_error(parent, f"allocating {nbytes * len(self.keys) / 2**20:.1f} MiB of {what} "
                                            f"({len(self.keys)} file(s) of {nbytes} bytes)", error) from error
        # Unlinked while open: the files live as long as this process holds them, so nothing is
        # left behind however the worker ends (closed, killed by Ray, SIGKILL); their space shows
        # in the file system's usage (df), not in a listing.
        for key in self.keys:
            os.unlink(os.path.join(self.folder, f"{key}.f32"))
        os.rmdir(self.folder)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroray-offload")
        self.io_lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.io_seconds = 0.0  # summed over the pool's threads

    # --- asynchronous reads and writes ------------------------------------------------------

    def read(self, key: str, start: int, out: torch.Tensor, after: Sequence[Future] = ()) -> Future:
        """Fill the 1D CPU tensor ``out`` (of the files' dtype) with elements [start, start + out.numel()), once the
        operations ``after`` have ended (waited for on the pool's thread, not the caller's: the
        pool starts its tasks in order, so those have started before this one and it cannot
        wait on a task that waits for a thread)."""
        return self.pool.submit(self._io, read_exactly, key, start, out, list(after))

    def write(self, key: str, start: int, src: torch.Tensor) -> Future:
        """Write the 1D CPU tensor ``src`` (of the files' dtype) at elements [start, start + src.numel())."""
        return self.pool.submit(self._io, write_all, key, start, src, [])

    def _io(self, op, key: str, start: int, tensor: torch.Tensor, after: List[Future]) -> None:
        counted_io(self, op, self.fds[key], tensor.detach(), start * self.element_bytes, after, repr(key))

    # --- whole ranges, synchronously (checkpoints) -----------------------------------------

    def read_now(self, key: str, start: int, end: int) -> torch.Tensor:
        out = torch.empty(end - start, dtype=self.dtype)
        self.read(key, start, out).result()
        return out

    def write_now(self, key: str, start: int, src: torch.Tensor) -> None:
        self.write(key, start, src.detach().to(self.dtype).contiguous()).result()

    def close(self) -> None:
        """Stop the pool and close the files, which frees their space (they are scratch)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self._finalizer()


def counted_io(owner, op, fd: int, tensor: torch.Tensor, offset: int, after: List[Future], what: str) -> None:
    """``op`` (``read_exactly`` or ``write_all``) between the file ``fd`` at byte ``offset`` and the
    contiguous CPU ``tensor``, once ``after`` ended, counted into ``owner``'s totals (its
    ``io_lock``, ``io_seconds``, ``bytes_read``, ``bytes_written``); an OSError becomes an
    OffloadError naming ``owner.folder`` and ``what``."""
    for future in after:
        future.result()  # a failed write fails the read that follows it
    t0 = time.perf_counter()
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # as bytes: numpy has no bfloat16
    try:
        op(fd, view, offset)
    except OSError as error:
        raise offload_error(owner.folder, f"{'reading' if op is read_exactly else 'writing'} {what}", error) from error
    with owner.io_lock:
        owner.io_seconds += time.perf_counter() - t0
        if op is read_exactly:
            owner.bytes_read += len(view)
        else:
            owner.bytes_written += len(view)


def read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from the file at byte ``offset`` (an error if the file ends first)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, "the state file ended early")
        done += got


def write_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` into the file at byte ``offset``."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _remove(fds: Dict[str, int], folder: str) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
