"""Full weights written as a Hugging Face model directory that ``from_pretrained`` loads.

[Note: streamed export]
The directory is what ``save_pretrained`` writes: ``config.json`` plus ``model.safetensors``,
or, past ``max_shard_bytes``, ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {name: file}}``).
A safetensors header lists every tensor's name, shape and byte offsets before any data, so
the plan comes first, without any weights: the names, shapes and dtypes of the model that the
config describes, from a meta-device build (``describe``), tied groups written once under the
name ``from_pretrained`` expects ([Note: names in the files]), cut into files in state_dict
order as ``save_pretrained`` cuts them. Then each file is streamed with the checkpoint
package's ``write_tensors``, which asks for one tensor at a time. The plan also checks the
input: a name the architecture lacks (wrong config) or a tensor it needs that is missing
(``from_pretrained`` would initialise it at random) is an error, not a silently bad export.

Files are written atomically and ``config.json`` last, so an interrupted export has no
config.json and ``from_pretrained`` refuses it instead of loading part of it; the shard files
of a failed export are deleted, and weight files of an earlier export into the same
directory that this one does not replace are deleted after it succeeds.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

import torch

from zeroray.checkpoint.consolidate import read_full_param
from zeroray.checkpoint.filesystem import PathLike, resolve
from zeroray.checkpoint.reader import CheckpointReader
from zeroray.checkpoint.tensorfile import TensorSpec, write_tensors
from zeroray.hf.architecture import CONFIG_NAME, as_dtype, build_model, describe, load_config
from zeroray.hf.files import INDEX_NAME, SINGLE_NAME

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SHOWN = 5

Tensors = Union[Mapping, Iterable[Tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ExportPlan:
    """Which tensors go to which file, in what dtype; see [Note: streamed export]."""

    files: List[Tuple[str, List[TensorSpec]]]
    kept: Dict[str, str]  # every name of a tied group -> the one name written
    class_name: str
    config: Any  # the transformers config written as config.json

    @property
    def names(self) -> List[str]:
        return [s.name for _, specs in self.files for s in specs]

    def written_as(self, name: str) -> str:
        return self.kept.get(name, name)


def _listing(names: List[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(repr(n) for n in names[:_SHOWN]) + more


def plan_export(config: Any, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                dtype: Union[None, str, torch.dtype] = None, model_class: Optional[type] = None) -> ExportPlan:
    """The files, their tensors and the config.json of an export, from the config alone."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is invalid: it must be an integer >= 1")
    dtype = as_dtype(dtype)
    cfg = load_config(config)
    info = describe(lambda: build_model(cfg, model_class, torch.float32))
    specs = []
    for name in info.file_names:
        shape, own = info.specs[name]
        specs.append(TensorSpec(name, dtype if dtype is not None and own.is_floating_point else own, shape))
    groups: List[List[TensorSpec]] = [[]]
    size = 0
    for s in specs:  # save_pretrained's rule: a new file when this tensor would overflow the current one
        if groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    n = len(groups)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    cfg.architectures = [info.class_name]
    cfg.dtype = dtype or torch.float32
    return ExportPlan(list(zip(names, groups)), info.kept, info.class_name, cfg)


# --- where the tensors come from ---------------------------------------------------------------


class _FromMapping:
    """Random access by name (a state dict, or a checkpoint read lazily): checked up front."""

    def __init__(self, tensors: Mapping, plan: ExportPlan) -> None:
        self.tensors = tensors
        self.source: Dict[str, str] = {}  # written name -> the input name that provides it
        names, unexpected = set(plan.names), []
        for name in tensors:
            written = plan.written_as(name)
            if written not in names:
                unexpected.append(name)
            self.source.setdefault(written, name)
        if unexpected:
            raise _unexpected_error(plan, unexpected)
        missing = [n for n in plan.names if n not in self.source]
        if missing:
            raise _missing_error(plan, missing)

    def fetch(self, name: str) -> torch.Tensor:
        return self.tensors[self.source[name]]

    def finish(self) -> None:
        pass


class _FromStream:
    """A one-pass iterator of (name, tensor): consumed in order; a tensor that arrives before
    its turn in the files is held until then. In state_dict order none is, except where a file
    mixes dtypes (``write_tensors`` puts the wider ones first: an int64 buffer before fp32)."""

    def __init__(self, pairs: Iterable[Tuple[str, torch.Tensor]], plan: ExportPlan) -> None:
        self.pairs: Iterator = iter(pairs)
        self.plan = plan
        self.names = set(plan.names)
        self.held: Dict[str, torch.Tensor] = {}
        self.done: Set[str] = set()

    def _take(self, name: str, tensor: torch.Tensor) -> None:
        written = self.plan.written_as(name)
        if written not in self.names:
            raise _unexpected_error(self.plan, [name])
        if written not in self.done and written not in self.held:  # else a tied duplicate: dropped
            self.held[written] = tensor

    def fetch(self, name: str) -> torch.Tensor:
        while name not in self.held:
            try:
                self._take(*next(self.pairs))
            except StopIteration:
                raise _missing_error(self.plan, [n for n in self.plan.names
                                                 if n not in self.done and n not in self.held]) from None
        self.done.add(name)
        return self.held.pop(name)

    def finish(self) -> None:
        for name, tensor in self.pairs:  # only to check that nothing unexpected follows
            self._take(name, tensor)


def _unexpected_error(plan: ExportPlan, names: List[str]) -> ValueError:
    return ValueError(f"{_listing(names)}: not a tensor of {plan.class_name} as built from this config "
                      f"(it has {_listing(plan.names)}); give the config of the model these weights "
                      "belong to, or model_class= its class")


def _missing_error(plan: ExportPlan, names: List[str]) -> ValueError:
    return ValueError(f"no tensor for {_listing(names)}, which {plan.class_name} as built from this config "
                      "has and from_pretrained would initialise at random; pass every tensor of the "
                      "model's state_dict (frozen parameters and buffers too)")


# --- writing -----------------------------------------------------------------------------------


def _prepare(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{spec.name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != spec.shape:
        raise ValueError(f"{spec.name!r} has shape {list(tensor.shape)} but the config describes "
                         f"{list(spec.shape)}; give the config of the model these weights belong to")
    return tensor.detach().to(device="cpu", dtype=spec.dtype)


def _write(plan: ExportPlan, source, out_dir: PathLike, metadata: Dict[str, str]) -> List[str]:
    storage, root = resolve(out_dir)
    storage.makedirs(root)
    done: List[str] = []
    try:
        for file, specs in plan.files:
            path = storage.join(root, file)
            with storage.atomic_writer(path) as out:
                write_tensors(out, specs, lambda s: _prepare(source.fetch(s.name), s), metadata)
            done.append(path)
        source.finish()
    except BaseException:
        for path in done:
            storage.delete_file(path)
        raise
    keep = {file for file, _ in plan.files}
    for entry in storage.list_dir(root):  # an earlier export's weights would confuse from_pretrained
        if not entry.is_dir and entry.name not in keep and (
                entry.name in (SINGLE_NAME, INDEX_NAME) or _SHARD_FILE.fullmatch(entry.name)):
            storage.delete_file(storage.join(root, entry.name))
    if len(plan.files) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for _, specs in plan.files for s in specs)},
                 "weight_map": {s.name: file for file, specs in plan.files for s in specs}}
        path = storage.join(root, INDEX_NAME)
        storage.write_bytes(path, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        done.append(path)
    path = storage.join(root, CONFIG_NAME)
    storage.write_bytes(path, plan.config.to_json_string(use_diff=True).encode())
    return [storage.display(p) for p in done + [path]]


def export_pretrained(named_tensors: Tensors, out_dir: PathLike, *, config: Any,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      dtype: Union[None, str, torch.dtype] = None,
                      model_class: Optional[type] = None) -> List[str]:
    """Write full weights to ``out_dir`` (a directory path or URI) as a Hugging Face model:
    config.json plus safetensors, split at ``max_shard_bytes`` with an index, loadable with
    ``from_pretrained(out_dir)``. See [Note: streamed export].

    ``named_tensors``: a mapping name -> tensor (e.g. ``trainer.state_dict()``), or an iterable
    of (name, tensor) pairs, consumed once, one tensor held at a time when it comes in
    state_dict order. ``config``: a transformers config, a dict with ``model_type``, or a path
    to a model directory or config.json. ``model_class``: the class the weights belong to
    (default ``AutoModelForCausalLM``). ``dtype``: floating tensors are written in it (default
    fp32); others keep theirs. Tied weights are written once. Returns the files written.
    """
    plan = plan_export(config, max_shard_bytes=max_shard_bytes, dtype=dtype, model_class=model_class)
    source = (_FromMapping(named_tensors, plan) if isinstance(named_tensors, Mapping)
              else _FromStream(named_tensors, plan))
    return _write(plan, source, out_dir, {"format": "pt"})


class _CheckpointTensors(Mapping):
    """A sharded checkpoint's full tensors by name, each assembled only when asked for."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.params = set(reader.layout.slots)  # canonical names and tied aliases
        self.extra = set(reader.extra_names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.params:
            return read_full_param(self.reader, name)
        if name in self.extra:
            return self.reader.read_extra(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.params | self.extra))

    def __len__(self) -> int:
        return len(self.params | self.extra)


def export_checkpoint(path: PathLike, out_dir: PathLike, *, config: Any,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      dtype: Union[None, str, torch.dtype] = None, model_class: Optional[type] = None,
                      verify: bool = True) -> List[str]:
    """``export_pretrained`` of a zeroray sharded checkpoint (its fp32 master weights, plus
    the frozen parameters and buffers it saved), streamed: one full parameter in memory at a
    time, assembled by ranged reads of the shards that hold it."""
    plan = plan_export(config, max_shard_bytes=max_shard_bytes, dtype=dtype, model_class=model_class)
    with CheckpointReader(path, verify=verify) as reader:
        source = _FromMapping(_CheckpointTensors(reader), plan)
        return _write(plan, source, out_dir, {"format": "pt", "zeroray.step": str(reader.manifest.step)})
