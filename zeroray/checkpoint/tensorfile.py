"""Streaming reads and writes of the safetensors format, on any ``Storage``.

[Note: why our own safetensors I/O]
The format is tiny: an 8-byte little-endian header length, a JSON header mapping each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus optional string ``__metadata__``),
then the raw little-endian bytes. The ``safetensors`` library reads and writes whole files
from local paths or ``bytes``. Doing the two ends ourselves lets us
- write one tensor at a time into any stream (a local temp file or an S3 upload), hashing
  the bytes as they go, so writing costs no second copy of a rank's state and consolidating
  a model holds one parameter in memory, not the whole model;
- read any element range of any tensor with one ranged read, on object stores too, which
  is what resharding and streaming consolidation need.
The files are ordinary safetensors: ``safetensors.torch.load_file`` reads them (the tests
check), and we read files the library wrote.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import RangeFile

_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64}
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _CODES[_code] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _CODES.items()}

_MAX_HEADER = 100 * 2**20  # the library's own limit; a bigger "header" is a damaged file
_CHUNK = 8 * 2**20


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored in a safetensors file; "
                         f"use one of {sorted(str(d) for d in _NAMES)}")
    return _NAMES[dtype]


def dtype_from_code(code: str) -> torch.dtype:
    if code not in _CODES:
        raise CheckpointError(f"safetensors dtype {code!r} is not supported by this torch build")
    return _CODES[code]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    # View as bytes (works for bf16 / bool, which numpy lacks); one tensor's bytes, no copy.
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class _HashingStream:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> None:
        self.sha.update(data)
        self.stream.write(data)
        self.nbytes += len(data)


def write_tensors(stream: BinaryIO, specs: Sequence[TensorSpec],
                  fetch: Callable[[TensorSpec], torch.Tensor],
                  metadata: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    """Write a safetensors file to ``stream``, calling ``fetch(spec)`` once per tensor, in the
    order of ``specs`` except that wider dtypes go first (a stable sort), which keeps every
    tensor aligned to its item size. Returns (bytes written, sha256 hex)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names must be unique in one file, repeated: {dup}")
    ordered = sorted(specs, key=lambda s: -s.dtype.itemsize)
    header: Dict[str, object] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(v, str)}
        if bad:
            raise ValueError(f"safetensors metadata values must be strings, got {bad}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for s in ordered:
        header[s.name] = {"dtype": dtype_code(s.dtype), "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the library pads the header to 8 bytes too
    out = _HashingStream(stream)
    out.write(struct.pack("<Q", len(raw)))
    out.write(raw)
    for s in ordered:
        t = fetch(s)
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"tensor {s.name!r}: expected {s.dtype} {list(s.shape)}, "
                             f"got {t.dtype} {list(t.shape)}")
        out.write(_as_bytes(t))
    return out.nbytes, out.sha.hexdigest()


def sha256_of(rf: RangeFile) -> str:
    sha = hashlib.sha256()
    buf = bytearray(min(_CHUNK, max(rf.size, 1)))
    pos = 0
    while pos < rf.size:
        n = min(len(buf), rf.size - pos)
        view = memoryview(buf)[:n]
        rf.readinto_at(pos, view)
        sha.update(view)
        pos += n
    return sha.hexdigest()


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class TensorFileReader:
    """Random access to the tensors of one safetensors file; validates the header on open."""

    def __init__(self, rf: RangeFile) -> None:
        self.file = rf
        where = rf.display
        if rf.size < 8:
            raise CheckpointError(f"{where}: {rf.size} bytes is too short for a safetensors file; "
                                  "it is truncated or not a checkpoint file")
        (hlen,) = struct.unpack("<Q", rf.read_at(0, 8))
        if hlen > min(_MAX_HEADER, rf.size - 8):
            raise CheckpointError(f"{where}: header length {hlen} does not fit in the {rf.size}-byte "
                                  "file; it is truncated or not a safetensors file")
        try:
            header = json.loads(rf.read_at(8, hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{where}: the safetensors header is not valid JSON ({e}); "
                                  "the file is damaged") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{where}: the safetensors header is not a JSON object; damaged file")
        self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
        base = 8 + hlen
        self.entries: Dict[str, _Entry] = {}
        data_end = 0
        for name, e in header.items():
            try:
                dtype = _CODES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{where}: bad header entry for {name!r}: {e!r} ({err!r})") from err
            if end - begin != _numel(shape) * dtype.itemsize or begin < 0:
                raise CheckpointError(f"{where}: tensor {name!r} has {end - begin} bytes for shape "
                                      f"{list(shape)} of {e['dtype']}; the file is damaged")
            self.entries[name] = _Entry(dtype, shape, base + begin, base + end)
            data_end = max(data_end, end)
        if base + data_end != rf.size:
            raise CheckpointError(
                f"{where}: the header describes {base + data_end} bytes but the file has {rf.size}; "
                "it is truncated or was appended to")

    def _entry(self, name: str) -> _Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.file.display}: no tensor {name!r} in this file "
                                  f"(it has {sorted(self.entries)})")
        return self.entries[name]

    def spec(self, name: str) -> TensorSpec:
        e = self._entry(name)
        return TensorSpec(name, e.dtype, e.shape)

    def read(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        return self.read_flat(name, 0, _numel(e.shape)).reshape(e.shape)

    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``, as a new 1-D tensor."""
        return self.read_flat_ranges(name, [(start, end)])[0]

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of the flattened tensor ``name``, written
        into the 1-D tensor ``out`` (any dtype or device: converted as copied). A contiguous CPU
        ``out`` of the stored dtype is filled by one read, with no temporary; otherwise the bytes
        pass through a buffer of at most ``_CHUNK`` bytes. Returns ``out``."""
        e = self._entry(name)
        n, size = _numel(e.shape), e.dtype.itemsize
        end = start + out.numel()
        if out.dim() != 1 or not 0 <= start <= end <= n:
            raise ValueError(f"{self.file.display}: cannot read elements [{start}, {end}) of tensor "
                             f"{name!r} ({n} elements) into a tensor of shape {list(out.shape)}")
        if out.numel() and out.dtype == e.dtype and out.device.type == "cpu" and out.is_contiguous():
            self.file.readinto_at(e.begin + start * size, memoryview(out.view(torch.uint8).numpy()))
            return out
        step = max(_CHUNK // size, 1)
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            out[lo - start:hi - start].copy_(self.read_flat(name, lo, hi))
        return out

    def read_flat_ranges(self, name: str, ranges: Sequence[Tuple[int, int]],
                         max_gap_bytes: int = 2**20) -> List[torch.Tensor]:
        """Several element ranges of one tensor. Ranges closer than ``max_gap_bytes`` are read
        with one request: object stores charge per request, and a few wasted bytes are cheaper."""
        e = self._entry(name)
        n, size = _numel(e.shape), e.dtype.itemsize
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= n:
                raise CheckpointError(f"{self.file.display}: range [{lo}, {hi}) is outside tensor "
                                      f"{name!r} of {n} elements; the checkpoint does not match its manifest")
        out: List[Optional[torch.Tensor]] = [None] * len(ranges)
        order = sorted((r for r in range(len(ranges)) if ranges[r][1] > ranges[r][0]),
                       key=lambda r: ranges[r][0])
        i = 0
        while i < len(order):
            lo, hi = ranges[order[i]]
            j = i + 1
            while j < len(order) and (ranges[order[j]][0] - hi) * size <= max_gap_bytes:
                hi = max(hi, ranges[order[j]][1])
                j += 1
            window = torch.empty(hi - lo, dtype=e.dtype)
            self.file.readinto_at(e.begin + lo * size, memoryview(window.view(torch.uint8).numpy()))
            for r in order[i:j]:
                a, b = ranges[r]
                out[r] = window[a - lo:b - lo] if j - i == 1 else window[a - lo:b - lo].clone()
            i = j
        return [t if t is not None else torch.empty(0, dtype=e.dtype) for t in out]
