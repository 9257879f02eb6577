"""What ``zeroray inspect CKPT`` and ``zeroray consolidate CKPT OUT`` do (cli.py parses the
arguments and calls these). Each returns the process exit code: 0 success, 1 a checkpoint
problem (printed to stderr, one line, saying what to do)."""
from __future__ import annotations

import json
import math
import sys
from typing import Optional, TextIO

from zeroray.checkpoint.consolidate import consolidate, parameter_count
from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike
from zeroray.checkpoint.reader import CheckpointReader
from zeroray.checkpoint.store import load_manifest
from zeroray.checkpoint.tensorfile import dtype_from_code
from zeroray.layout.owners import split_owned_key


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def cli_inspect(path: PathLike, out: Optional[TextIO] = None) -> int:
    """Print step, world size, config, parameter count and the files (with their sizes and
    whether they are present at the recorded size). Checksums are not computed here."""
    out = out or sys.stdout
    try:
        m = load_manifest(path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reader = CheckpointReader(m, verify=False)
    trainable, extra = parameter_count(m)
    print(f"checkpoint: {m.source}", file=out)
    print(f"step: {m.step}", file=out)
    print(f"world size: {m.world_size}", file=out)
    print(f"data position: {m.data_position}", file=out)
    print(f"parameters: {trainable:,} trainable in {len(m.flat_layout().units)} units"
          + (f", {extra:,} in frozen parameters and buffers" if m.extra_tensors else ""), file=out)
    print(f"sharded tensors: {', '.join(m.sharded_keys)}", file=out)
    owned = m.owned_keys
    if owned:
        names = set(m.flat_layout().param_names)
        params = {split_owned_key(k, names)[0] for k in owned}
        state_keys = sorted({split_owned_key(k, names)[1] for k in owned})
        nbytes = [0] * m.world_size
        for key, rank in owned.items():
            entry = m.tensors[key]
            nbytes[rank] += math.prod(entry["shape"]) * dtype_from_code(entry["dtype"]).itemsize
        print(f"whole-parameter optimizer state: {len(owned)} tensors ({', '.join(state_keys)}) of "
              f"{len(params)} parameters, by owner rank: {', '.join(_size(b) for b in nbytes)}", file=out)
    print(f"config: {json.dumps(m.config, sort_keys=True)}", file=out)
    if m.extra:
        print(f"extra: {json.dumps(m.extra, sort_keys=True)}", file=out)
    print("files:", file=out)
    problems = 0
    for e in m.files():
        found = reader.storage.entry(reader.storage.join(reader.dir, e.file))
        status = "ok"
        if found is None:
            status, problems = "MISSING", problems + 1
        elif found.size != e.bytes:
            status, problems = f"SIZE {found.size} != {e.bytes}", problems + 1
        print(f"  {e.file:<28} {_size(e.bytes):>12}  {status}", file=out)
    total = sum(e.bytes for e in m.files())
    print(f"total: {_size(total)}", file=out)
    if problems:
        print(f"error: {problems} file(s) missing or of the wrong size; this checkpoint cannot be "
              "loaded, use an older one", file=sys.stderr)
        return 1
    return 0


def cli_consolidate(path: PathLike, out_file: PathLike, out: Optional[TextIO] = None) -> int:
    """Write the full model of checkpoint ``path`` to the safetensors file ``out_file``."""
    out = out or sys.stdout
    try:
        m = load_manifest(path)
        written = consolidate(m, out_file)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    trainable, extra = parameter_count(m)
    print(f"wrote {written}: step {m.step}, {trainable + extra:,} elements "
          "(load with model.load_state_dict(safetensors.torch.load_file(...)))", file=out)
    return 0
