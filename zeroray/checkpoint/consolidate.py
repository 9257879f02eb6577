"""Full parameters from a sharded checkpoint, one parameter at a time.

``iter_full_params`` assembles each trainable parameter from the slices of the shard files
that hold it (ranged reads: one parameter in memory, never all shards). ``consolidate``
streams them into one plain safetensors file keyed like ``model.state_dict()``:
- tied parameters appear under every name (canonical and aliases) with equal values,
  written as separate copies because safetensors has no shared storage;
- frozen parameters and buffers are included when the runtime saved them in the
  checkpoint's extra file (``store.write_extra``), so the result loads with
  ``model.load_state_dict(..., strict=True)``; without it, use ``strict=False``.
Values are the fp32 master weights (training in bf16/fp16 keeps fp32 masters).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterator, List, Tuple, Union

import torch

from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike, resolve
from zeroray.checkpoint.manifest import Manifest
from zeroray.checkpoint.reader import CheckpointReader
from zeroray.checkpoint.tensorfile import TensorSpec, dtype_from_code, write_tensors


def _param_pieces(layout: FlatLayout, name: str) -> Dict[int, List[Tuple[int, int, int]]]:
    """rank -> [(local_start, local_end, param_offset)]: where ``name``'s elements sit in the
    local shards (one piece per rank that owns part of it)."""
    slot = layout.slots[name]
    unit = layout.units[slot.unit]
    pieces: Dict[int, List[Tuple[int, int, int]]] = defaultdict(list)
    first = slot.offset // unit.shard_numel
    last = (slot.offset + slot.numel - 1) // unit.shard_numel if slot.numel else first - 1
    for rank in range(first, last + 1):
        start, lo, hi = layout.param_shard_range(name, rank)
        if hi > lo:
            pieces[rank].append((start, start + hi - lo, lo))
    return pieces


def _assemble(reader: CheckpointReader, name: str, dtype: torch.dtype) -> torch.Tensor:
    slot = reader.layout.slots[name]
    flat = torch.empty(slot.numel, dtype=dtype)
    for rank, pieces in _param_pieces(reader.layout, name).items():
        slices = reader.read_slices(rank, "master", [(a, b) for a, b, _ in pieces])
        for (a, b, offset), piece in zip(pieces, slices):
            flat[offset:offset + b - a].copy_(piece)
    return flat.reshape(slot.shape)


def read_full_param(reader: CheckpointReader, name: str) -> torch.Tensor:
    """One full trainable parameter, by its canonical or tied-alias name, in the checkpoint's
    master dtype and its own shape (ranged reads of the shards that hold it)."""
    if name not in reader.layout.slots:
        raise CheckpointError(f"{reader.storage.display(reader.dir)}: no trainable parameter {name!r} in "
                              "this checkpoint")
    return _assemble(reader, name, dtype_from_code(reader.manifest.tensors["master"]["dtype"]))


def iter_full_params(path: Union[PathLike, Manifest], verify: bool = True,
                     with_aliases: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, full fp32 parameter of its shape) for every trainable parameter, in layout
    order, canonical names only (``with_aliases=True``: tied aliases follow their canonical
    name, as clones)."""
    reader = CheckpointReader(path, verify=verify)
    try:
        dtype = dtype_from_code(reader.manifest.tensors["master"]["dtype"])
        for name in reader.layout.param_names:
            full = _assemble(reader, name, dtype)
            yield name, full
            if with_aliases:
                for alias in reader.layout.slots[name].aliases:
                    yield alias, full.clone()
    finally:
        reader.close()


def consolidate(path: Union[PathLike, Manifest], out_file: PathLike, verify: bool = True) -> str:
    """Write the full model (trainable parameters with aliases, plus the extra file's frozen
    parameters and buffers) to one safetensors file at ``out_file`` (a path or URI), atomically.
    Memory: one parameter at a time. Returns the written location."""
    with CheckpointReader(path, verify=verify) as reader:
        m, layout = reader.manifest, reader.layout
        dtype = dtype_from_code(m.tensors["master"]["dtype"])
        specs: List[TensorSpec] = []
        canonical: Dict[str, str] = {}
        for name in layout.param_names:
            slot = layout.slots[name]
            for n in (name, *slot.aliases):
                specs.append(TensorSpec(n, dtype, slot.shape))
                canonical[n] = name
        clash = sorted(set(m.extra_keys) & set(canonical))
        if clash:
            raise CheckpointError(f"{reader.storage.display(reader.dir)}: extra tensors {clash} have the "
                                  "names of trainable parameters; the checkpoint is inconsistent")
        for n, e in m.extra_keys.items():
            specs.append(TensorSpec(n, dtype_from_code(e["dtype"]), tuple(e["shape"])))

        cache: Dict[str, torch.Tensor] = {}  # the last assembled parameter, for its aliases

        def fetch(spec: TensorSpec) -> torch.Tensor:
            if spec.name not in canonical:
                return reader.read_extra(spec.name)
            name = canonical[spec.name]
            if name not in cache:
                cache.clear()
                cache[name] = _assemble(reader, name, dtype)
            return cache[name]

        storage, out_path = resolve(out_file)
        parent = storage.split(out_path)[0]
        if parent:
            storage.makedirs(parent)
        with storage.atomic_writer(out_path) as out:
            write_tensors(out, specs, fetch, {"format": "pt", "zeroray.step": str(m.step)})
        return storage.display(out_path)


def full_state_dict(path: Union[PathLike, Manifest], verify: bool = True) -> Dict[str, torch.Tensor]:
    """Everything ``consolidate`` writes, in memory (for small models and tests)."""
    out = dict(iter_full_params(path, verify=verify, with_aliases=True))
    with CheckpointReader(path, verify=verify) as reader:
        for name in reader.extra_names:
            out[name] = reader.read_extra(name)
    return out


def parameter_count(manifest: Manifest) -> Tuple[int, int]:
    """(trainable elements, extra-file elements) of a checkpoint, from its manifest alone."""
    extra = 0
    for e in manifest.extra_keys.values():
        n = 1
        for s in e["shape"]:
            n *= s
        extra += n
    return manifest.flat_layout().numel, extra
