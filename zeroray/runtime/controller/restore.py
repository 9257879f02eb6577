"""``Trainer.restore(..., fallback=True)``: load the newest checkpoint that verifies.

The candidates come from the checkpoint package (checkpoint/verify.py): newest first, a
root's every complete checkpoint, or a step directory and the older ones beside it. For each,
the driver reads the manifest and the workers check the files in parallel (each its share,
so the whole checkpoint is read once); the first that passes is loaded. Verifying before
loading matters: a load is collective at stages 1-2 (the workers publish what they read), so
a load that failed on one worker only would leave the others waiting in a gather, while a
verification fails on its own and leaves the group usable for the next candidate.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from zeroray.checkpoint import CheckpointError, Manifest, SkippedCheckpoint, load_manifest, restore_candidates
from zeroray.runtime.controller.optimizer_restore import RestoreChoice, choose
from zeroray.runtime.controller.controller import Controller

log = logging.getLogger("zeroray")


def check_has_candidates(path: Any) -> None:
    """Fail before any worker starts when ``path`` holds nothing to try."""
    candidates, interrupted = restore_candidates(path)
    if not candidates:
        raise CheckpointError(f"{path} holds no complete checkpoint to restore"
                              + (f" ({len(interrupted)} interrupted save(s): {[s.path for s in interrupted]})"
                                 if interrupted else "") + "; give a checkpoint root or a step_<N> directory")


def newest_manifest(path: Any) -> Optional[Manifest]:
    """The manifest of the newest candidate under ``path`` that reads (what a fallback restore
    builds its optimizer from: runtime/controller/optimizer_restore.py), or None."""
    for step_dir in restore_candidates(path)[0]:
        try:
            return load_manifest(step_dir)
        except CheckpointError:
            continue
    return None


def load_newest_valid(controller: Controller, path: Any) -> Tuple[Any, List[SkippedCheckpoint]]:
    """Load the newest candidate under ``path`` that verifies; (its directory, the ones skipped)."""
    candidates, skipped = restore_candidates(path)
    for step_dir in candidates:
        try:
            load_manifest(step_dir)
            controller.verify(step_dir)
        except CheckpointError as error:
            skipped.append(SkippedCheckpoint(str(step_dir), str(error).splitlines()[0]))
            continue
        controller.load(step_dir)
        for s in skipped:
            log.warning("zeroray: restore skipped %s: %s", s.path, s.reason)
        if skipped:
            log.warning("zeroray: restored %s, the newest checkpoint that verifies", step_dir)
        return step_dir, skipped
    reasons = "\n".join(f"  {s.path}: {s.reason}" for s in skipped)
    raise CheckpointError(f"{path}: no checkpoint there verifies, so there is nothing to restore:\n{reasons}")


def restore_choice(path: Any, fallback: bool, given: Dict[str, Any], fresh_optimizer: bool) -> RestoreChoice:
    """What ``Trainer.restore`` builds its optimizer from, read from the checkpoint at ``path``
    (with ``fallback``, the newest that has a manifest) before any worker starts, so a checkpoint
    that cannot be read fails with its own error; ``given``: the optimizer parts the caller passed."""
    if fallback:
        check_has_candidates(path)
    manifest = newest_manifest(path) if fallback else load_manifest(path)
    return choose(manifest.optimizer if manifest is not None else None, manifest.source if manifest else path,
                  given, fresh_optimizer)
