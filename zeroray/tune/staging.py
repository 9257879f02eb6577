"""Where a trial's checkpoint is written before Tune takes it, and how a Tune checkpoint is read.

[Note: Tune checkpoints]
A trial's Tune checkpoint is a zeroray sharded checkpoint: the step directory ``Trainer.save``
writes (``manifest.json``, one safetensors shard per worker, the extra tensors; data only).
``tune.report(metrics, checkpoint=...)`` copies the directory it is given into the trial's
storage (``RunConfig(storage_path=...)``) before it returns, so the trial saves into a staging
root first: every worker writes its own shard there, the driver commits the manifest, Tune
copies the step directory, and the staged copy is deleted. The workers of a trial may run on
other nodes than its driver, whose view of the staging root Tune copies from; so after each
save the driver checks that it sees every file the manifest lists, at its size, and a staging
root the workers cannot share with it (a node-local temporary directory on a cluster without a
shared file system) is refused with an error that says to give ``staging=`` (a shared directory
or a ``pyarrow.fs`` URI such as ``s3://bucket/tmp``) instead of a checkpoint that would lack
shards. Reading one back needs no copy: ``Trainer.restore`` is given the checkpoint's path on
Tune's storage (through a ``StoragePath`` for a remote one), and each worker reads only its own
slices of it, at whatever worker count the trial has.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Optional

from ray import tune

from zeroray.checkpoint import StoragePath, load_manifest
from zeroray.checkpoint.filesystem import ArrowStorage, LocalStorage, resolve


def zeroray_path(checkpoint: tune.Checkpoint) -> Any:
    """Where ``Trainer.restore`` reads a Tune checkpoint: its local path, or a StoragePath on its
    pyarrow file system (S3, GCS, ...), so that each worker reads its slices in place."""
    fs = checkpoint.filesystem
    if fs is None or fs.type_name == "local":
        return checkpoint.path
    return StoragePath(ArrowStorage(fs, fs.type_name), checkpoint.path)


def check_whole(step_dir: Any) -> None:
    """Every file the manifest of ``step_dir`` lists is there, at its size, as this process sees it;
    a ValueError that says to share the staging directory otherwise ([Note: Tune checkpoints])."""
    storage, inner = resolve(step_dir)
    for entry in load_manifest(step_dir).files():
        found = storage.entry(storage.join(inner, entry.file))
        if found is None or found.size != entry.bytes:
            raise ValueError(
                f"zeroray.tune: the workers wrote {entry.file} of checkpoint {step_dir}, but the trial's driver "
                f"{'does not see it' if found is None else f'sees {found.size} of its {entry.bytes} bytes'}: the "
                "staging directory is not shared between the trial's nodes. Give zt.trainable(..., staging=...) a "
                "directory every node mounts, or a URI such as s3://bucket/tmp")


class Staging:
    """One trial's staging root: ``staging`` (a directory or URI every worker and the trial's
    driver reach; the trial gets a directory of its own in it), or a temporary directory on the
    trial's node. Removed by ``close``."""

    def __init__(self, staging: Optional[str], trial_id: str) -> None:
        if staging is None:
            self.root: str = tempfile.mkdtemp(prefix=f"zeroray-tune-{trial_id}-")
        else:
            storage, inner = resolve(staging)
            sub = f"{trial_id}-{uuid.uuid4().hex[:8]}"
            self.root = os.path.join(inner, sub) if isinstance(storage, LocalStorage) else f"{staging.rstrip('/')}/{sub}"
        self.storage, self.inner = resolve(self.root)

    def save(self, trainer: Any) -> Any:
        """``trainer.save`` into the staging root; the step directory, checked to be whole as the
        driver sees it ([Note: Tune checkpoints])."""
        step_dir = trainer.save(self.root)
        check_whole(step_dir)
        return step_dir

    def checkpoint(self, step_dir: Any) -> tune.Checkpoint:
        """A Tune checkpoint of a staged step directory (Tune copies it into its storage)."""
        storage, inner = resolve(step_dir)
        if isinstance(storage, ArrowStorage):
            return tune.Checkpoint(path=inner, filesystem=storage.fs)
        return tune.Checkpoint.from_directory(inner)

    def drop(self, step_dir: Any) -> None:
        """Delete a staged step directory once Tune has its copy."""
        storage, inner = resolve(step_dir)
        storage.delete_dir(inner)

    def close(self) -> None:
        if isinstance(self.storage, LocalStorage):
            shutil.rmtree(self.inner, ignore_errors=True)
        else:
            self.storage.delete_dir(self.inner)
