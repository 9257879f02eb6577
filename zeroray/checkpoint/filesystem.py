"""Where checkpoint bytes live: a local directory, or any ``pyarrow.fs`` URI.

[Note: atomic writes]
A reader must never see half a file under its final name. Local filesystems get that from
write-to-temp + ``rename`` (atomic within one filesystem); object stores (S3, GCS) get it for
free, because an object only becomes visible when its upload completes, and they have no
atomic rename (``move`` is copy + delete), so there we write to the final name directly.
Temporary names contain ``.tmp.``; nothing that lists a checkpoint ever treats them as data,
and ``store.commit`` deletes the stale ones a crashed writer left behind.

Plain paths use ``os`` (no pyarrow needed); anything with ``://`` goes through
``pyarrow.fs.FileSystem.from_uri``, imported only then; a ``StoragePath`` names its own
``Storage`` (a storage of the user's, or one that fails on purpose: faults.py).
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from typing import BinaryIO, Iterator, List, Optional, Tuple, Union

from zeroray.checkpoint.errors import CheckpointError

TMP_MARKER = ".tmp."


def is_temp_name(name: str) -> bool:
    return TMP_MARKER in name


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool
    size: Optional[int]


class RangeFile:
    """A file opened for reads at absolute offsets."""

    def __init__(self, handle, size: int, display: str) -> None:
        self._handle = handle
        self.size = size
        self.display = display

    def readinto_at(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a byte memoryview) from ``offset``; a short read is a damaged file."""
        self._handle.seek(offset)
        got = 0
        while got < len(out):
            n = self._handle.readinto(out[got:])
            if not n:
                raise CheckpointError(
                    f"{self.display}: wanted {len(out)} bytes at offset {offset} but the file ends "
                    f"after {offset + got}; the file is truncated, restore it or use an older checkpoint")
            got += n

    def read_at(self, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self.readinto_at(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "RangeFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Storage:
    """File operations on one filesystem; paths are strings in that filesystem's syntax."""

    atomic_rename: bool = True

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def split(self, path: str) -> Tuple[str, str]:
        raise NotImplementedError

    def display(self, path: str) -> str:
        """The path as the user would write it (URIs keep their scheme), for messages."""
        return path

    def temp_path(self, path: str) -> str:
        head, tail = self.split(path)
        # Hidden and unique per writer, so parallel writers never collide and listings skip it.
        return self.join(head, f".{tail}{TMP_MARKER}{uuid.uuid4().hex[:12]}")

    def entry(self, path: str) -> Optional[Entry]:
        raise NotImplementedError

    def list_dir(self, path: str) -> List[Entry]:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        raise NotImplementedError

    def open_range(self, path: str) -> RangeFile:
        raise NotImplementedError

    def _open_output(self, path: str) -> BinaryIO:
        raise NotImplementedError

    def _rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def delete_file(self, path: str) -> None:
        """Delete ``path``; an absent file is not an error (another writer may have won)."""
        raise NotImplementedError

    def delete_dir(self, path: str) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def atomic_writer(self, path: str) -> Iterator[BinaryIO]:
        """A stream whose bytes appear at ``path`` all at once on success, never partially.
        See [Note: atomic writes]."""
        target = self.temp_path(path) if self.atomic_rename else path
        stream = self._open_output(target)
        try:
            yield stream
            if self.atomic_rename:
                self._sync(stream)
            stream.close()
        except BaseException:
            # On an object store close() may still publish the partial upload (pyarrow exposes
            # no abort), so the target is deleted afterwards either way.
            with contextlib.suppress(Exception):
                stream.close()
            with contextlib.suppress(Exception):
                self.delete_file(target)
            raise
        if self.atomic_rename:
            self._rename(target, path)

    def _sync(self, stream) -> None:
        pass

    def read_bytes(self, path: str) -> bytes:
        with self.open_range(path) as f:
            return f.read_at(0, f.size)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.atomic_writer(path) as out:
            out.write(data)


class LocalStorage(Storage):
    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def split(self, path: str) -> Tuple[str, str]:
        return os.path.split(path)

    def entry(self, path: str) -> Optional[Entry]:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        is_dir = os.path.isdir(path)
        return Entry(os.path.basename(path.rstrip(os.sep)), is_dir, None if is_dir else st.st_size)

    def list_dir(self, path: str) -> List[Entry]:
        out = []
        with os.scandir(path) as it:
            for e in it:
                is_dir = e.is_dir()
                out.append(Entry(e.name, is_dir, None if is_dir else e.stat().st_size))
        return out

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_range(self, path: str) -> RangeFile:
        handle = open(path, "rb", buffering=0)
        return RangeFile(handle, os.fstat(handle.fileno()).st_size, path)

    def _open_output(self, path: str) -> BinaryIO:
        return open(path, "wb")

    def _sync(self, stream) -> None:
        # Data on disk before the rename makes it visible; else a power loss can leave an
        # empty file under the final name.
        stream.flush()
        os.fsync(stream.fileno())

    def _rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        # Persist the rename itself (the directory entry), best effort: not every OS allows it.
        with contextlib.suppress(OSError):
            fd = os.open(os.path.dirname(dst) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def delete_dir(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class ArrowStorage(Storage):
    """Any ``pyarrow.fs`` filesystem (S3, GCS, HDFS, local through ``file://``)."""

    def __init__(self, fs, scheme: str) -> None:
        self.fs = fs
        self.scheme = scheme
        # Only a local filesystem renames atomically; see [Note: atomic writes].
        self.atomic_rename = fs.type_name == "local"

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def split(self, path: str) -> Tuple[str, str]:
        return posixpath.split(path)

    def display(self, path: str) -> str:
        return f"{self.scheme}://{path}"  # s3 paths are "bucket/key", file paths "/abs"

    def entry(self, path: str) -> Optional[Entry]:
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return None
        is_dir = info.type == pafs.FileType.Directory
        return Entry(info.base_name, is_dir, None if is_dir else info.size)

    def list_dir(self, path: str) -> List[Entry]:
        from pyarrow import fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return [Entry(i.base_name, i.type == pafs.FileType.Directory,
                      None if i.type == pafs.FileType.Directory else i.size) for i in infos]

    def makedirs(self, path: str) -> None:
        self.fs.create_dir(path, recursive=True)

    def open_range(self, path: str) -> RangeFile:
        handle = self.fs.open_input_file(path)
        return RangeFile(handle, handle.size(), self.display(path))

    def _open_output(self, path: str) -> BinaryIO:
        return self.fs.open_output_stream(path)

    def _rename(self, src: str, dst: str) -> None:
        self.fs.move(src, dst)

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(path)

    def delete_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(path)


@dataclass(frozen=True)
class StoragePath:
    """A path on a given ``Storage``: pass it wherever a checkpoint path goes
    (``CheckpointConfig(path=...)``, ``save``, ``Trainer.restore``) to read and write through a
    storage of your own. It travels to the workers with the calls that use it, so the storage
    must pickle. Paths derived from it (a step directory, ``latest_checkpoint``) are StoragePaths
    on the same storage; ``str()`` gives the path as messages show it."""

    storage: Storage
    path: str

    def __str__(self) -> str:
        return self.storage.display(self.path)


PathLike = Union[str, "os.PathLike[str]", StoragePath]


def same_kind(like: PathLike, storage: Storage, path: str) -> PathLike:
    """``path`` on ``storage``, in the form ``like`` was given in: a StoragePath for a StoragePath
    (so later reads go through the same storage), otherwise the path as the user writes it."""
    return StoragePath(storage, path) if isinstance(like, StoragePath) else storage.display(path)


def resolve(path: PathLike) -> Tuple[Storage, str]:
    """(storage, path inside it) for a local path, a ``scheme://`` URI or a StoragePath."""
    if isinstance(path, StoragePath):
        return path.storage, path.path
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"checkpoint path {path!r} is invalid: give a directory path or a URI")
    if "://" not in text:
        return LocalStorage(), os.path.abspath(text)
    try:
        from pyarrow import fs as pafs
    except ImportError as e:  # pragma: no cover - pyarrow is installed with ray
        raise CheckpointError(
            f"{text}: URIs need pyarrow (pip install pyarrow), or give a local path") from e
    try:
        fs, inner = pafs.FileSystem.from_uri(text)
    except Exception as e:
        raise CheckpointError(f"{text}: pyarrow cannot open this URI ({e}); check the scheme and "
                              "credentials, or give a local path") from e
    return ArrowStorage(fs, text.split("://", 1)[0]), inner.rstrip("/") or "/"
