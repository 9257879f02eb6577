"""Reading a checkpoint's tensors back, each file checked against the manifest.

A file is checked when first opened: its size always (cheap: catches truncation and
missing files), its sha256 once per reader when ``verify`` (streamed in chunks, so memory
stays small). Reads are ranged: a reader never loads a whole shard it only needs part of.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple, Union

import torch

from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike, resolve
from zeroray.checkpoint.manifest import FileEntry, Manifest
from zeroray.checkpoint.store import load_manifest
from zeroray.checkpoint.tensorfile import TensorFileReader, sha256_of


class CheckpointReader:
    """Reads tensors of one checkpoint, opening each file on first use and checking it against
    the manifest (size; sha256 when ``verify``) exactly once. Use as a context manager."""

    _MAX_OPEN = 32  # open files kept; a world of thousands of ranks must not exhaust descriptors

    def __init__(self, path_or_manifest: Union[PathLike, Manifest], verify: bool = True) -> None:
        m = path_or_manifest if isinstance(path_or_manifest, Manifest) else load_manifest(path_or_manifest)
        location = m.location
        if location is None:
            if not m.source:
                raise ValueError("this Manifest does not say where it was loaded from; pass the "
                                 "checkpoint path instead")
            location = resolve(m.source)
        self.manifest = m
        self.layout = m.flat_layout()
        self.storage, self.dir = location
        self.verify = verify
        self._open: "OrderedDict[str, TensorFileReader]" = OrderedDict()
        self._verified: set = set()

    def _reader(self, entry: FileEntry) -> TensorFileReader:
        if entry.file in self._open:
            self._open.move_to_end(entry.file)
            return self._open[entry.file]
        path = self.storage.join(self.dir, entry.file)
        where = self.storage.display(path)
        try:
            rf = self.storage.open_range(path)
        except OSError as e:
            if self.storage.entry(path) is None:
                raise CheckpointError(f"{where} is missing (the manifest lists it with {entry.bytes} "
                                      "bytes); the checkpoint is damaged, load an older one") from e
            raise
        try:
            if rf.size != entry.bytes:
                raise CheckpointError(f"{where} has {rf.size} bytes but the manifest says {entry.bytes}: "
                                      "it is truncated or was overwritten; load an older checkpoint")
            if self.verify and entry.file not in self._verified:
                digest = sha256_of(rf)
                if digest != entry.sha256:
                    raise CheckpointError(f"{where} is corrupted: sha256 {digest} but the manifest "
                                          f"says {entry.sha256}; load an older checkpoint")
                self._verified.add(entry.file)
            reader = TensorFileReader(rf)
        except BaseException:
            rf.close()
            raise
        self._open[entry.file] = reader
        if len(self._open) > self._MAX_OPEN:
            self._open.popitem(last=False)[1].file.close()
        return reader

    def check(self, entry: FileEntry) -> None:
        """Open ``entry`` (one of ``manifest.files()``) and check it against the manifest: present,
        its size, its sha256 when ``verify``. Raises CheckpointError naming it if it is damaged."""
        self._reader(entry)

    def shard(self, rank: int) -> TensorFileReader:
        if not 0 <= rank < self.manifest.world_size:
            raise ValueError(f"rank {rank} is outside the checkpoint's world size {self.manifest.world_size}")
        return self._reader(self.manifest.shards[rank])

    def read_slices(self, rank: int, key: str, ranges: Sequence[Tuple[int, int]]) -> List[torch.Tensor]:
        """Element ranges of one tensor of old rank ``rank``'s shard file."""
        return self.shard(rank).read_flat_ranges(key, ranges)

    @property
    def extra_names(self) -> List[str]:
        return list(self.manifest.extra_keys)

    def read_extra(self, name: str) -> torch.Tensor:
        if self.manifest.extra_tensors is None:
            raise CheckpointError(f"{self.storage.display(self.dir)} has no extra tensors file")
        return self._reader(self.manifest.extra_tensors).read(name)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].file.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_shard_slices(path_or_manifest: Union[PathLike, Manifest], rank: int, key: str,
                      ranges: Sequence[Tuple[int, int]], verify: bool = True) -> List[torch.Tensor]:
    """Element ranges ``[(start, end), ...]`` of tensor ``key`` of rank ``rank``'s shard file."""
    with CheckpointReader(path_or_manifest, verify=verify) as reader:
        return reader.read_slices(rank, key, ranges)


def load_extra(path_or_manifest: Union[PathLike, Manifest], verify: bool = True) -> Dict[str, torch.Tensor]:
    """The full tensors of ``extra.safetensors`` ({} when the checkpoint has none)."""
    with CheckpointReader(path_or_manifest, verify=verify) as reader:
        return {name: reader.read_extra(name) for name in reader.extra_names}
