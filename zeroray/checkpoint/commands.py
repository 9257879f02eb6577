"""What ``zeroray inspect CKPT`` and ``zeroray consolidate CKPT OUT`` do (cli.py parses the
arguments and calls these). Each returns the process exit code: 0 success, 1 a checkpoint
problem (printed to stderr, one line, saying what to do)."""
from __future__ import annotations

import json
import math
import sys
from typing import List, Optional, TextIO

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
    """Print step, world size, config, parameter count, the optimizer record and the files (with
    their sizes and whether they are present at the recorded size). Checksums are not computed here."""
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
    for line in _optimizer_lines(m.optimizer):
        print(line, file=out)
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


def _optimizer_lines(record: Optional[dict]) -> List[str]:
    """The manifest's optimizer record ([Note: optimizer record] in zeroray/engine/optim_record.py)
    in a few lines: what was built, from what, each param group (its overrides, how many
    parameters, the values that moved since it was built) and the scheduler's state."""
    if record is None:
        return ["optimizer: not recorded (saved before zeroray recorded the optimizer: restore needs optimizer=)"]
    spec = record["spec"]
    made_by = (f"zr.{spec['class']} {json.dumps(spec['fields'], sort_keys=True)}" if spec["kind"] == "zeroray"
               else f"zr.elementwise({spec['name']})" if spec["kind"] == "elementwise" else spec["name"])
    lines = [f"optimizer: {record['class']}, built by {made_by}",
             f"  defaults: {json.dumps(record['defaults'], sort_keys=True)}"
             + (f" (not recorded: {', '.join(record['unrecorded'])})" if record["unrecorded"] else ""),
             f"  state keys: {', '.join(record['state_keys']) if record['state_keys'] is not None else 'unknown'}",
             f"  param groups: {len(record['groups'])}"
             + (f" (overrides from {record['param_groups']})" if record["param_groups"] else "")]
    for g in record["groups"]:
        initial, current = g.get("initial") or {}, g.get("current") or {}
        moved = {k: v for k, v in current.items() if initial.get(k, None) != v or k not in initial}
        names = ", ".join(g["params"][:3]) + (f" (+{len(g['params']) - 3} more)" if len(g["params"]) > 3 else "")
        lines.append(f"    overrides {json.dumps(g['overrides'], sort_keys=True)}: {len(g['params'])} parameter(s) "
                     f"({names}); now {json.dumps(moved, sort_keys=True)}")
    sched = record.get("scheduler")
    if sched is not None:
        lines.append(f"  scheduler: {sched['class']}: {json.dumps(sched['current'], sort_keys=True)}")
    return lines


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
