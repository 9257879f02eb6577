"""Saving and finding checkpoints: the write protocol, ``latest``, retention, verified reads.

[Note: checkpoint commit protocol]
On disk (a local directory or any pyarrow.fs URI)::

    <root>/step_<step:08d>/shard_<rank:05d>.safetensors   one per rank, written by that rank
    <root>/step_<step:08d>/extra.safetensors              optional, frozen params + buffers (rank 0)
    <root>/step_<step:08d>/manifest.json                  written last by the driver
    <root>/latest                                         "step_<step:08d>", the newest commit

1. Every worker calls ``write_shard`` in parallel; each file is written atomically
   ([Note: atomic writes]). Writing into a step directory first deletes its manifest, so a
   directory being (re)written is never mistaken for a complete one.
2. The driver calls ``commit`` with the returned ``ShardInfo``s. It checks them, writes
   ``manifest.json`` (the commit point), then ``latest``, then deletes checkpoints beyond the
   newest ``keep`` and the leftovers of interrupted saves.
A directory without ``manifest.json`` is incomplete and ignored. A crash before the manifest
leaves the previous checkpoint as the latest; a crash between manifest and ``latest`` leaves
``latest`` naming the previous (still complete) one. ``latest_checkpoint`` trusts ``latest``
when it names a complete checkpoint and otherwise falls back to the highest complete step.

Reading the files back, verified against the manifest: reader.py.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import is_owned_key
from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike, Storage, is_temp_name, resolve, same_kind
from zeroray.checkpoint.manifest import (EXTRA_NAME, MANIFEST_NAME, FileEntry, FileKind, Manifest,
                                         ManifestFields, ShardInfo,
                                         parse_step_dir, read_manifest, shard_name, step_dir_name,
                                         write_manifest)
from zeroray.checkpoint.tensorfile import TensorSpec, dtype_code, write_tensors

LATEST_NAME = "latest"


def is_sharded_key(key: str, value: Any, shard_numel: int) -> bool:
    """The engine contract: "master" and any "optim.*" 1-D tensor of ``shard_numel`` elements
    are sharded (resharded N -> M); other tensors are per-rank and copied whole."""
    return (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard_numel
            and (key == "master" or key.startswith("optim.")))


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} is invalid: it must be an integer >= 0")


def _check_tensors(tensors: Any, what: str) -> None:
    if not isinstance(tensors, Mapping):
        raise ValueError(f"{what} must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")
    bad = {k: type(v).__name__ for k, v in tensors.items()
           if not isinstance(k, str) or not isinstance(v, torch.Tensor)}
    if bad:
        raise ValueError(f"{what} must map string names to tensors; these entries are not: {bad} "
                         "(pass JSON-able values through `scalars` instead)")


def _write_file(storage: Storage, path: str, tensors: Mapping[str, torch.Tensor],
                metadata: Dict[str, str]) -> Tuple[int, str, Tuple]:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with storage.atomic_writer(path) as out:
        nbytes, sha = write_tensors(out, specs, lambda s: tensors[s.name], metadata)
    described = tuple((s.name, dtype_code(s.dtype), s.shape) for s in specs)
    return nbytes, sha, described


def _open_step_dir(root: PathLike, step: int) -> Tuple[Storage, str]:
    storage, root_path = resolve(root)
    step_dir = storage.join(root_path, step_dir_name(step))
    storage.makedirs(step_dir)
    # See [Note: checkpoint commit protocol]: a directory being written is not complete.
    storage.delete_file(storage.join(step_dir, MANIFEST_NAME))
    return storage, step_dir


# --- writers (run on the workers) ------------------------------------------------------------


def write_shard(root: PathLike, step: int, rank: int, tensors: Mapping[str, Any],
                scalars: Optional[Dict[str, Any]] = None) -> ShardInfo:
    """Write rank ``rank``'s state as ``<root>/step_<step>/shard_<rank>.safetensors``.

    ``tensors``: the flat local-shard tensors ("master", "optim.*"); a "scalars" entry is
    taken as ``scalars`` when that argument is None. ``scalars`` must be JSON-able; they
    travel to the manifest through the returned ShardInfo."""
    _check_step(step)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank={rank!r} is invalid: it must be an integer >= 0")
    tensors = dict(tensors)
    if "scalars" in tensors and not isinstance(tensors["scalars"], torch.Tensor):
        extra_scalars = tensors.pop("scalars")
        scalars = extra_scalars if scalars is None else scalars
    scalars = {} if scalars is None else scalars
    _check_tensors(tensors, "write_shard(tensors=...)")
    try:
        scalars = json.loads(json.dumps(scalars))
    except (TypeError, ValueError) as e:
        raise ValueError(f"rank {rank} scalars are not JSON-able ({e}); encode tensors or bytes "
                         "as lists or base64 strings") from e
    storage, step_dir = _open_step_dir(root, step)
    nbytes, sha, described = _write_file(
        storage, storage.join(step_dir, shard_name(rank)), tensors,
        {"format": "pt", "zeroray.step": str(step), "zeroray.rank": str(rank)})
    return ShardInfo(shard_name(rank), nbytes, sha, rank=rank, kind=FileKind.SHARD, tensors=described,
                     scalars=scalars)


def write_extra(root: PathLike, step: int, tensors: Mapping[str, torch.Tensor]) -> ShardInfo:
    """Write full tensors that are not sharded (frozen parameters, buffers), keyed by their
    ``state_dict`` names, once (from rank 0), as ``extra.safetensors``; hand the returned
    ShardInfo to ``commit`` along with the shards'."""
    _check_step(step)
    _check_tensors(tensors, "write_extra(tensors=...)")
    storage, step_dir = _open_step_dir(root, step)
    nbytes, sha, described = _write_file(storage, storage.join(step_dir, EXTRA_NAME), tensors,
                                         {"format": "pt", "zeroray.step": str(step)})
    return ShardInfo(EXTRA_NAME, nbytes, sha, rank=None, kind=FileKind.EXTRA, tensors=described)


# --- commit (runs on the driver) -------------------------------------------------------------


def _classify(infos: List[ShardInfo], layout: FlatLayout) -> Dict[str, Dict[str, Any]]:
    """Each tensor key's entry: dtype, shape, whether sharded, and for a whole parameter's
    optimizer state (layout/owners.py), which is in its owner's file only, that rank ("owner")."""
    common = [[t for t in info.tensors if not is_owned_key(t[0])] for info in infos]
    first = common[0]
    for info, keys in zip(infos[1:], common[1:]):
        if sorted(keys) != sorted(first):
            raise ValueError(f"rank {info.rank} wrote tensors {sorted(keys)} but rank "
                             f"{infos[0].rank} wrote {sorted(first)}; every rank must save the same keys")
    out = {}
    for key, code, shape in first:
        fake = torch.empty(tuple(shape), device="meta")
        out[key] = {"dtype": code, "shape": list(shape),
                    "sharded": is_sharded_key(key, fake, layout.shard_numel)}
    for info in infos:
        for key, code, shape in info.tensors:
            if is_owned_key(key):
                if key in out:
                    raise ValueError(f"ranks {out[key]['owner']} and {info.rank} both wrote {key!r}: a parameter's "
                                     "optimizer state has one owner")
                out[key] = {"dtype": code, "shape": list(shape), "sharded": False, "owner": info.rank}
    if "master" not in out or not out["master"]["sharded"]:
        got = out["master"]["shape"] if "master" in out else "nothing"
        raise ValueError(f"the shards' \"master\" tensor has shape {got}, but the layout needs a 1-D "
                         f"tensor of shard_numel={layout.shard_numel} elements: the shards were "
                         "written for another layout or world size")
    return out


def commit(root: PathLike, step: int, manifest_fields: Union[ManifestFields, Mapping[str, Any]],
           shard_infos: Sequence[ShardInfo], keep: Optional[int] = None) -> PathLike:
    """Make ``step`` a complete checkpoint and the latest one; returns its directory (a
    StoragePath when ``root`` is one, else a string).

    ``manifest_fields``: a ManifestFields (layout, config, data_position, extra, optimizer), or a dict of
    those names (see ``ManifestFields.of``).
    ``shard_infos``: every rank's ShardInfo and, if one was written, the extra file's.
    ``keep``: after committing, keep only the newest ``keep`` complete checkpoints (None: all).
    See [Note: checkpoint commit protocol]."""
    _check_step(step)
    given = ManifestFields.of(manifest_fields)
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep={keep!r} is invalid: it must be an integer >= 1 or None (keep all)")
    layout = given.layout
    shards = sorted((i for i in shard_infos if i.kind is FileKind.SHARD), key=lambda i: i.rank)
    extras = [i for i in shard_infos if i.kind is FileKind.EXTRA]
    world_size = layout.world_size
    ranks = [i.rank for i in shards]
    if ranks != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        raise ValueError(f"commit needs exactly one ShardInfo per rank 0..N-1 (N={world_size}, the "
                         f"layout's world size), got ranks {ranks}, missing {missing}; wait for every "
                         "worker's write_shard, and pass the layout the workers used")
    if len(extras) > 1:
        raise ValueError(f"at most one extra file per checkpoint, got {len(extras)}")

    storage, root_path = resolve(root)
    step_dir = storage.join(root_path, step_dir_name(step))
    _check_written(storage, step_dir, shards + extras)
    extra = extras[0] if extras else None
    manifest = Manifest(
        step=step, world_size=world_size, layout=layout.to_dict(),
        shards=[FileEntry(i.file, i.bytes, i.sha256) for i in shards],
        scalars=[i.scalars or {} for i in shards], tensors=_classify(shards, layout),
        config=given.config, data_position=given.data_position, extra=given.extra,
        extra_tensors=FileEntry(extra.file, extra.bytes, extra.sha256) if extra else None,
        extra_keys={k: {"dtype": c, "shape": list(s)} for k, c, s in extra.tensors} if extra else {},
        optimizer=given.optimizer, source=storage.display(step_dir))
    write_manifest(storage, step_dir, manifest)
    storage.write_bytes(storage.join(root_path, LATEST_NAME), (step_dir_name(step) + "\n").encode())
    _clean_temps(storage, step_dir)
    _clean_temps(storage, root_path)
    _retain(storage, root_path, step, keep)
    return same_kind(root, storage, step_dir)


def _check_written(storage: Storage, step_dir: str, infos: Sequence[ShardInfo]) -> None:
    present = {e.name: e.size for e in storage.list_dir(step_dir)} if storage.entry(step_dir) else {}
    for i in infos:
        if present.get(i.file) != i.bytes:
            raise CheckpointError(
                f"{storage.display(storage.join(step_dir, i.file))}: expected {i.bytes} bytes, found "
                f"{'no file' if i.file not in present else f'{present[i.file]} bytes'}; the writer "
                "saved elsewhere or the file was changed; nothing was committed, save again")


def _clean_temps(storage: Storage, directory: str) -> None:
    for e in storage.list_dir(directory):
        if not e.is_dir and is_temp_name(e.name):
            storage.delete_file(storage.join(directory, e.name))


def _delete_checkpoint(storage: Storage, step_dir: str) -> None:
    # Manifest first, so an interrupted delete leaves an incomplete (ignored) directory,
    # never a "complete" one with files missing.
    storage.delete_file(storage.join(step_dir, MANIFEST_NAME))
    storage.delete_dir(step_dir)


def _retain(storage: Storage, root_path: str, committed: int, keep: Optional[int]) -> None:
    complete, incomplete = _scan(storage, root_path)
    if keep is not None:
        others = [s for s in sorted(complete, reverse=True) if s != committed]
        for s in others[keep - 1:]:
            _delete_checkpoint(storage, complete[s])
    for s, path in incomplete.items():
        if s < committed:  # leftovers of an interrupted save; newer ones may belong to a writer
            storage.delete_dir(path)


# --- finding checkpoints ---------------------------------------------------------------------


def _scan(storage: Storage, root_path: str) -> Tuple[Dict[int, str], Dict[int, str]]:
    """(complete, incomplete) step directories under ``root_path``: step -> path."""
    complete: Dict[int, str] = {}
    incomplete: Dict[int, str] = {}
    if storage.entry(root_path) is None:
        return complete, incomplete
    for e in storage.list_dir(root_path):
        step = parse_step_dir(e.name) if e.is_dir else None
        if step is None:
            continue
        path = storage.join(root_path, e.name)
        has_manifest = storage.entry(storage.join(path, MANIFEST_NAME)) is not None
        (complete if has_manifest else incomplete)[step] = path
    return complete, incomplete


def _latest(storage: Storage, root_path: str) -> Optional[str]:
    pointer = storage.join(root_path, LATEST_NAME)
    if storage.entry(pointer) is not None:
        name = storage.read_bytes(pointer).decode(errors="replace").strip()
        if parse_step_dir(name) is not None:
            candidate = storage.join(root_path, name)
            if storage.entry(storage.join(candidate, MANIFEST_NAME)) is not None:
                return candidate
    complete, _ = _scan(storage, root_path)
    return complete[max(complete)] if complete else None


def latest_checkpoint(root: PathLike) -> Optional[PathLike]:
    """The directory of the latest complete checkpoint under ``root``, or None if there is none."""
    storage, root_path = resolve(root)
    found = _latest(storage, root_path)
    return same_kind(root, storage, found) if found else None


def list_checkpoints(root: PathLike, incomplete: bool = False) -> List[Tuple[int, PathLike]]:
    """Complete checkpoints under ``root`` as (step, directory), oldest first (``incomplete``:
    the step directories without a manifest instead, the leftovers of interrupted saves)."""
    storage, root_path = resolve(root)
    found = _scan(storage, root_path)[1 if incomplete else 0]
    return [(s, same_kind(root, storage, found[s])) for s in sorted(found)]


def checkpoint_dir(path: PathLike) -> PathLike:
    """The step directory ``path`` names: itself, or for a root the latest complete checkpoint
    under it (every worker of a restore must read the same step, even if a save lands meanwhile)."""
    manifest = load_manifest(path)
    storage, step_dir = manifest.location
    return same_kind(path, storage, step_dir)


def load_manifest(path: PathLike) -> Manifest:
    """The manifest of a step directory, of the latest checkpoint under a root (following
    ``latest``), or of a ``manifest.json`` path."""
    storage, p = resolve(path)
    entry = storage.entry(p)
    where = storage.display(p)
    if entry is None:
        raise CheckpointError(f"{where} does not exist; give a checkpoint root or step directory")
    if not entry.is_dir:
        if entry.name == MANIFEST_NAME:
            return read_manifest(storage, storage.split(p)[0])
        raise CheckpointError(f"{where} is a file, not a checkpoint; give the checkpoint root "
                              "directory or a step_<N> directory inside it")
    names = {e.name: e for e in storage.list_dir(p)}
    if MANIFEST_NAME in names:
        return read_manifest(storage, p)
    steps = [n for n, e in names.items() if e.is_dir and parse_step_dir(n) is not None]
    if parse_step_dir(storage.split(p)[1]) is not None:
        raise CheckpointError(f"{where} has no {MANIFEST_NAME}: that save was interrupted, so the "
                              "checkpoint is incomplete; load the root to get the latest complete one")
    if LATEST_NAME not in names and not steps:
        raise CheckpointError(f"{where} is not a zeroray checkpoint: it has no {MANIFEST_NAME}, no "
                              f"'{LATEST_NAME}' file and no step_<N> directories")
    found = _latest(storage, p)
    if found is None:
        raise CheckpointError(f"{where} holds no complete checkpoint (incomplete: {sorted(steps)}); "
                              "every save there was interrupted before its manifest was written")
    return read_manifest(storage, found)
