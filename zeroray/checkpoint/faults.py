"""Storages that fail on purpose: how to test what a full disk or a failing write does to a run.

``FullDisk`` wraps a storage (the local filesystem by default) and fails writes the way a
full disk does: with ``OSError(ENOSPC)`` at a chosen byte of the files it is told to fail.
Hand it to a run through a ``StoragePath``::

    from zeroray.checkpoint import StoragePath
    from zeroray.checkpoint.faults import FullDisk

    disk = FullDisk(free_bytes=4096, match="step_00000004/shard_00001")
    trainer = zr.Trainer(..., checkpoint=zr.CheckpointConfig(path=StoragePath(disk, "ckpts/"), every_steps=2))

The storage object travels to the workers with every save and load (it pickles), so the fault
hits the worker that writes the matching file, or the driver when the file is the manifest or
``latest``. What a run does about it: [Note: failed saves] in runtime/controller/checkpointing.py.
``StorageWrapper`` is the base for storages of this kind (the chaos benchmark's gates).
"""
from __future__ import annotations

import contextlib
import errno
import os
from typing import BinaryIO, Iterator, List, Optional, Tuple

from zeroray.checkpoint.filesystem import Entry, LocalStorage, RangeFile, Storage


class StorageWrapper(Storage):
    """Every operation goes to ``inner``; a subclass overrides the ones it changes."""

    def __init__(self, inner: Optional[Storage] = None) -> None:
        self.inner = inner if inner is not None else LocalStorage()

    @property
    def atomic_rename(self) -> bool:  # type: ignore[override]
        return self.inner.atomic_rename

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def split(self, path: str) -> Tuple[str, str]:
        return self.inner.split(path)

    def display(self, path: str) -> str:
        return self.inner.display(path)

    def temp_path(self, path: str) -> str:
        return self.inner.temp_path(path)

    def entry(self, path: str) -> Optional[Entry]:
        return self.inner.entry(path)

    def list_dir(self, path: str) -> List[Entry]:
        return self.inner.list_dir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def open_range(self, path: str) -> RangeFile:
        return self.inner.open_range(path)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    @contextlib.contextmanager
    def atomic_writer(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.atomic_writer(path) as stream:
            yield self.wrap_output(path, stream)

    def wrap_output(self, path: str, stream: BinaryIO) -> BinaryIO:
        """The stream a writer of ``path`` gets (by default ``stream`` itself)."""
        return stream


class FullDisk(StorageWrapper):
    """Writes to a file whose path contains ``match`` fail with ``OSError(ENOSPC)`` once that file
    holds ``free_bytes`` bytes: the bytes before that point are written, as on a disk that fills
    up mid-file. Other files, and every read, go through untouched."""

    def __init__(self, free_bytes: int, match: str = "", inner: Optional[Storage] = None) -> None:
        if not isinstance(free_bytes, int) or isinstance(free_bytes, bool) or free_bytes < 0:
            raise ValueError(f"free_bytes={free_bytes!r} must be an integer >= 0")
        super().__init__(inner)
        self.free_bytes, self.match = free_bytes, match

    def wrap_output(self, path: str, stream: BinaryIO) -> BinaryIO:
        return _FillingStream(stream, self.free_bytes, path) if self.match in path else stream

    def __repr__(self) -> str:
        return f"FullDisk(free_bytes={self.free_bytes}, match={self.match!r})"


class _FillingStream:
    """A write stream with room for ``room`` bytes; then ENOSPC."""

    def __init__(self, stream: BinaryIO, room: int, path: str) -> None:
        self.stream, self.room, self.path = stream, room, path
        self.written = 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        fits = max(0, min(len(data), self.room - self.written))
        if fits:
            self.stream.write(data[:fits])
            self.written += fits
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return fits

    def __getattr__(self, name: str):  # flush, fileno, close: the real stream's
        return getattr(self.stream, name)
