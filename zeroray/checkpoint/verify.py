"""Restoring with a fallback: which checkpoints to try, newest first, and checking every file of one.

``Trainer.restore(path, ..., fallback=True)`` tries the candidates in order and loads the first
one that verifies; each candidate whose manifest or files are damaged is skipped, and the
trainer says which and why. What counts as damaged is whatever ``CheckpointError`` reports
when reading (a manifest that is not JSON or names a file outside its directory, a file
missing, truncated, or whose sha256 differs). A checkpoint of another model is not damage:
it is an error, raised as it is, and no older checkpoint is tried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike, resolve, same_kind
from zeroray.checkpoint.manifest import parse_step_dir
from zeroray.checkpoint.reader import CheckpointReader
from zeroray.checkpoint.store import list_checkpoints


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a fallback restore did not load: its directory and why."""

    path: str
    reason: str


def restore_candidates(path: PathLike) -> Tuple[List[PathLike], List[SkippedCheckpoint]]:
    """(step directories to try, newest first; interrupted saves newer than all of them).

    ``path`` is a checkpoint root (every complete checkpoint under it) or a step directory (that
    one, then the older complete ones beside it). A step directory without a manifest is an
    interrupted save, never a candidate; the ones newer than every candidate are reported, so
    the user learns why the newest directory was not loaded."""
    storage, p = resolve(path)
    head, name = storage.split(p)
    step = parse_step_dir(name)
    root = same_kind(path, storage, head) if step is not None else path
    complete = [(s, d) for s, d in list_checkpoints(root) if step is None or s <= step]
    candidates = [d for _, d in sorted(complete, key=lambda c: -c[0])]
    if step is not None and not any(s == step for s, _ in complete):
        candidates.insert(0, path)  # load_manifest says why it is not a checkpoint
    newest = max((s for s, _ in complete), default=-1)
    interrupted = [SkippedCheckpoint(str(d), "the save was interrupted: it has no manifest.json")
                   for s, d in reversed(list_checkpoints(root, incomplete=True))
                   if s > newest and (step is None or s <= step)]
    return candidates, interrupted


def verify_files(step_dir: PathLike, names: Sequence[str]) -> None:
    """Check the files ``names`` of the checkpoint at ``step_dir`` against its manifest (present,
    size, sha256); raises CheckpointError naming the first that is damaged. Run on the workers,
    each on its share of the files, so a whole checkpoint is read once, in parallel."""
    with CheckpointReader(step_dir, verify=True) as reader:
        known = {e.file: e for e in reader.manifest.files()}
        for name in names:
            if name not in known:
                raise CheckpointError(f"{step_dir}: the manifest lists no file {name!r}")
            reader.check(known[name])
