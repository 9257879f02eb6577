"""The manifest: the JSON file that makes a step directory a complete checkpoint.

A checkpoint is ``<root>/step_<step:08d>/`` holding one ``shard_<rank:05d>.safetensors`` per
rank, optionally ``extra.safetensors`` (full frozen parameters and buffers, saved once), and
``manifest.json``, written last: its presence is what marks the directory complete (see
store.py). The manifest records everything needed to read the shards back at any world size:
the flat layout (world-size independent, see [Note: flat layout] in layout/arena.py), the world size
it was saved at, which tensor keys are sharded, each file's size and sha256, and the small
per-rank ``scalars`` (step counts, loss-scaler state, RNG states).
"""
from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple

from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint.errors import CheckpointError

FORMAT = "zeroray.checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
EXTRA_NAME = "extra.safetensors"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a ``step_<step:08d>`` directory name, None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _where(source: Optional[str]) -> str:
    if not source:
        return MANIFEST_NAME
    return source if source.endswith(MANIFEST_NAME) else f"{source.rstrip('/')}/{MANIFEST_NAME}"


class FileKind(enum.Enum):
    SHARD = "shard"  # one rank's sharded and per-rank tensors
    EXTRA = "extra"  # tensors outside the flat layout (untrained buffers), written once


@dataclass(frozen=True)
class ShardInfo:
    """What a writer reports to the driver about one file it wrote (picklable, small).

    file: name inside the step directory; bytes, sha256: of the whole file; rank: the writer's
    rank (None for the extra file); tensors: (key, dtype code, shape) of every tensor in it;
    scalars: the rank's JSON-able scalars (shards only)."""

    file: str
    bytes: int
    sha256: str
    rank: Optional[int] = None
    kind: FileKind = FileKind.SHARD
    tensors: Tuple[Tuple[str, str, Tuple[int, ...]], ...] = ()
    scalars: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class FileEntry:
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ManifestFields:
    """What the driver adds to the writers' ShardInfos to make a manifest (``commit``), checked
    once here: ``layout`` (the FlatLayout of the saved shards, or its ``to_dict()``), ``config``
    and ``extra`` (JSON-able dicts, kept as copies), ``data_position`` (an int >= 0), ``optimizer``
    (None, or the optimizer record: [Note: optimizer record] in engine/optim_record.py).

    ``of`` also takes the mapping form of earlier releases, ``{"layout": ..., "config": ...}``,
    whose optional ``world_size`` must match the layout's."""

    layout: FlatLayout
    config: Dict[str, Any] = field(default_factory=dict)
    data_position: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    optimizer: Optional[Dict[str, Any]] = None

    def __post_init__(self) -> None:
        layout = self.layout
        if isinstance(layout, dict):
            try:
                layout = FlatLayout.from_dict(layout)
            except Exception as e:  # noqa: BLE001 - any malformed dict: say which field
                raise ValueError(f"manifest field 'layout' cannot be read as a FlatLayout ({e!r}); pass the "
                                 "FlatLayout of the saved shards or its to_dict()") from e
        if not isinstance(layout, FlatLayout):
            raise ValueError(f"manifest field 'layout' must be the FlatLayout of the saved shards, "
                             f"got {type(layout).__name__}")
        object.__setattr__(self, "layout", layout)
        for name in ("config", "extra", "optimizer"):
            value = getattr(self, name)
            if value is None and name == "optimizer":
                continue
            if not isinstance(value, dict):
                raise ValueError(f"manifest field {name!r} must be a dict, got {type(value).__name__}")
            try:
                copy = json.loads(json.dumps(value))
            except (TypeError, ValueError) as e:
                raise ValueError(f"manifest field {name!r} must be a JSON-able dict ({e})") from e
            object.__setattr__(self, name, copy)
        position = self.data_position
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"manifest field 'data_position'={position!r} must be an integer >= 0")

    @classmethod
    def of(cls, given: Any) -> "ManifestFields":
        """``given`` as ManifestFields: itself, or checked from a mapping of the same names."""
        if isinstance(given, cls):
            return given
        if not isinstance(given, Mapping):
            raise ValueError(f"manifest fields must be a ManifestFields or a dict, got {type(given).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(given) - names - {"world_size"}
        if unknown:
            raise ValueError(f"commit(manifest_fields=...) has unknown keys {sorted(unknown)}; "
                             f"allowed: {sorted(names | {'world_size'})}")
        if "layout" not in given:
            raise ValueError("commit(manifest_fields=...) needs 'layout' (the FlatLayout of the saved shards)")
        made = cls(**{k: v for k, v in given.items() if k != "world_size"})
        if given.get("world_size", made.layout.world_size) != made.layout.world_size:
            raise ValueError(f"manifest field 'world_size'={given['world_size']} but the layout is for "
                             f"world_size={made.layout.world_size}")
        return made


_JSON_FIELDS = (("step", int), ("world_size", int), ("layout", dict), ("shards", list), ("scalars", list),
                ("tensors", dict), ("config", dict), ("data_position", int), ("extra", dict), ("extra_keys", dict))


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json``, checked once when it is built (``commit``) or read
    (``from_dict``): a Manifest that exists is well-formed (``__post_init__``). ``source`` (the
    step directory it was read from, for messages) and ``location`` are not serialized."""

    step: int
    world_size: int
    layout: Dict[str, Any]                 # FlatLayout.to_dict()
    shards: List[FileEntry]                # index = rank
    scalars: List[Dict[str, Any]]          # index = rank
    # key -> {"dtype": code, "sharded": bool, "shape": [...]}, and for a whole parameter's
    # optimizer state (layout/owners.py) "owner": the rank whose file alone holds it
    tensors: Dict[str, Dict[str, Any]]
    config: Dict[str, Any] = field(default_factory=dict)
    data_position: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    extra_tensors: Optional[FileEntry] = None
    extra_keys: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name -> {"dtype", "shape"}
    # the optimizer, its param groups and LR scheduler as data; None in a checkpoint from before
    # zeroray recorded them ([Note: optimizer record] in engine/optim_record.py)
    optimizer: Optional[Dict[str, Any]] = None
    created: float = field(default_factory=time.time)
    version: int = VERSION
    source: Optional[str] = field(default=None, compare=False)
    # (Storage, step directory) it was read from (None for one built in memory): how loaders
    # reach its files on the same storage, URI options kept. Not serialized.
    location: Optional[Tuple[Any, str]] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        self.validate()

    # --- derived -------------------------------------------------------------------------

    def flat_layout(self) -> FlatLayout:
        return FlatLayout.from_dict(self.layout, self.world_size)

    @property
    def sharded_keys(self) -> List[str]:
        return [k for k, v in self.tensors.items() if v["sharded"]]

    @property
    def rank_keys(self) -> List[str]:
        """Per-rank tensors that are not sharded (taken from one source rank when resharding)."""
        return [k for k, v in self.tensors.items() if not v["sharded"] and "owner" not in v]

    @property
    def owned_keys(self) -> Dict[str, int]:
        """Whole parameters' optimizer state: key -> the rank whose file holds it (read by
        whichever rank owns the parameter at the world size it is loaded at)."""
        return {k: v["owner"] for k, v in self.tensors.items() if "owner" in v}

    def files(self) -> List[FileEntry]:
        return list(self.shards) + ([self.extra_tensors] if self.extra_tensors else [])

    # --- (de)serialization -----------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (format version 1), field by field in declaration order."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("source", "location")}
        d["shards"] = [asdict(e) for e in self.shards]
        d["extra_tensors"] = asdict(self.extra_tensors) if self.extra_tensors else None
        if self.optimizer is None:  # a manifest from before the record reads back as it was written
            del d["optimizer"]
        return {"format": FORMAT, **json.loads(json.dumps(d))}  # a deep copy: the caller may change it

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Optional[str] = None,
                  location: Optional[Tuple[Any, str]] = None) -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{_where(source)}: not valid JSON ({e}); the manifest is damaged, "
                                  "load an older checkpoint") from e
        return cls.from_dict(d, source, location)

    @classmethod
    def from_dict(cls, d: Any, source: Optional[str] = None,
                  location: Optional[Tuple[Any, str]] = None) -> "Manifest":
        """``source``: the step directory (or manifest path) it came from, for messages."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise _damaged(source, f"missing \"format\": \"{FORMAT}\"")
        if d.get("version") != VERSION:
            raise CheckpointError(f"{_where(source)}: checkpoint format version {d.get('version')!r} is not "
                                  f"supported (this zeroray reads version {VERSION}); use a matching "
                                  "zeroray release")
        for key, _ in _JSON_FIELDS:
            if key not in d:
                raise _damaged(source, f"field {key!r} is missing")
        try:
            shards = [FileEntry(**e) for e in d["shards"]]
            extra_tensors = FileEntry(**d["extra_tensors"]) if d.get("extra_tensors") else None
        except TypeError as e:
            raise _damaged(source, f"a file entry is malformed ({e})") from e
        created = d.get("created", 0.0)
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise _damaged(source, f"field 'created' must be a number, got {type(created).__name__}")
        return cls(step=d["step"], world_size=d["world_size"], layout=d["layout"], shards=shards,
                   scalars=d["scalars"], tensors=d["tensors"], config=d["config"],
                   data_position=d["data_position"], extra=d["extra"], extra_tensors=extra_tensors,
                   extra_keys=d["extra_keys"], optimizer=d.get("optimizer"), created=float(created),
                   version=d["version"], source=source, location=location)

    def _check_types(self) -> None:
        for key, types in _JSON_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, types) or isinstance(value, bool):
                raise _damaged(self.source, f"field {key!r} must be {types.__name__}, got {type(value).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, dict):
            raise _damaged(self.source, f"field 'optimizer' must be a dict or null, got {type(self.optimizer).__name__}")
        for e in self.files():
            if not isinstance(e, FileEntry):
                raise _damaged(self.source, f"a file entry is malformed (a {type(e).__name__}, not a FileEntry)")
        for key, v in self.tensors.items():
            if not isinstance(v, dict):
                raise _damaged(self.source, f"field 'tensors' entry {key!r} must be a dict, got {type(v).__name__}")

    def validate(self) -> None:
        """Internal consistency; raises CheckpointError saying which field is wrong."""
        where = _where(self.source)

        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{where}: {what}")

        if self.step < 0:
            raise bad(f"step must be >= 0, got {self.step}")
        if self.world_size < 1:
            raise bad(f"world_size must be >= 1, got {self.world_size}")
        if self.data_position < 0:
            raise bad(f"data_position must be >= 0, got {self.data_position}")
        if len(self.shards) != self.world_size or len(self.scalars) != self.world_size:
            raise bad(f"world_size is {self.world_size} but there are {len(self.shards)} shard "
                      f"entries and {len(self.scalars)} scalar entries; the manifest is damaged")
        for e in self.files():
            if not isinstance(e.file, str) or not _FILE_NAME.match(e.file):
                raise bad(f"file name {e.file!r} is invalid (must be a plain name inside the step directory)")
            if not isinstance(e.bytes, int) or e.bytes < 0 or not isinstance(e.sha256, str) or len(e.sha256) != 64:
                raise bad(f"file entry {e} needs an integer byte size and a sha256 hex digest")
        try:
            layout = self.flat_layout()
        except Exception as e:
            raise bad(f"the layout cannot be read ({e!r})") from e
        if not any(v.get("sharded") for v in self.tensors.values()) or "master" not in self.tensors:
            raise bad(f"no sharded \"master\" tensor is listed (tensors: {sorted(self.tensors)})")
        for key, v in self.tensors.items():
            owner = v.get("owner")
            if owner is not None and (not isinstance(owner, int) or isinstance(owner, bool)
                                      or not 0 <= owner < self.world_size):
                raise bad(f"tensor {key!r} names owner {owner!r}, not a rank of world size {self.world_size}")
            if v.get("sharded") and list(v.get("shape", [])) != [layout.shard_numel]:
                raise bad(f"sharded tensor {key!r} has shape {v.get('shape')}, expected "
                          f"[{layout.shard_numel}] for the recorded layout")


def _damaged(source: Optional[str], what: str) -> CheckpointError:
    return CheckpointError(f"{_where(source)}: {what}; the manifest is damaged or not a zeroray checkpoint manifest")


# --- I/O ---------------------------------------------------------------------------------------


def write_manifest(storage, step_dir: str, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically ([Note: atomic writes]): it is the commit point (the
    Manifest checked itself when it was built)."""
    storage.write_bytes(storage.join(step_dir, MANIFEST_NAME), manifest.to_json().encode())


def read_manifest(storage, step_dir: str) -> Manifest:
    path = storage.join(step_dir, MANIFEST_NAME)
    where = storage.display(path)
    if storage.entry(path) is None:
        raise CheckpointError(f"{where} does not exist: {storage.display(step_dir)} is not a complete "
                              "checkpoint (an interrupted save leaves no manifest); load another step")
    try:
        text = storage.read_bytes(path).decode()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not UTF-8 text; the manifest is damaged") from e
    return Manifest.from_json(text, source=storage.display(step_dir), location=(storage, step_dir))
