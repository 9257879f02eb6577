"""A full disk during a save, at every point of the commit protocol: the write fails with ENOSPC,
nothing half-written appears, and the previous checkpoint stays ``latest`` and loads.

The disk is ``zeroray.checkpoint.faults.FullDisk`` reached through a ``StoragePath``, the same
way a run hands it to its workers. [Note: checkpoint commit protocol] in checkpoint/store.py.
"""
import errno
import os
import pickle

import pytest
import torch

from tests.unit.test_checkpoint_store import UNITS, save, shard_of, write_all
from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint import (StoragePath, checkpoint_dir, commit, latest_checkpoint, list_checkpoints,
                                load_resharded, write_extra)
from zeroray.checkpoint.faults import FullDisk


def _no_temp_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp." in f]


def _loads_as_step_one(root, logical):
    tensors, scalars = load_resharded(root, FlatLayout(UNITS, 2), 1)
    assert scalars["step"] == 1
    assert torch.equal(tensors["master"], shard_of(FlatLayout(UNITS, 2), logical, 1))


def test_full_disk_fails_the_matching_file_at_the_chosen_byte(tmp_path):
    disk = FullDisk(free_bytes=100, match="shard_00001")
    assert pickle.loads(pickle.dumps(disk)).free_bytes == 100  # it travels to the workers
    path = str(tmp_path / "a" / "shard_00001.safetensors")
    os.makedirs(os.path.dirname(path))
    with pytest.raises(OSError) as info:
        with disk.atomic_writer(path) as out:
            out.write(b"x" * 60)
            out.write(b"y" * 60)  # the disk fills up 40 bytes into this write
    assert info.value.errno == errno.ENOSPC and "No space left on device" in str(info.value)
    assert os.listdir(tmp_path / "a") == []  # the temp file was deleted, nothing under the final name
    disk.write_bytes(str(tmp_path / "a" / "other"), b"z" * 500)  # other files are not affected
    assert (tmp_path / "a" / "other").read_bytes() == b"z" * 500


@pytest.mark.parametrize("fails", ["shard_00001", "extra.safetensors", "manifest.json", "latest"])
def test_a_failed_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, fails):
    _, logical = save(tmp_path, 1, seed=1)
    root = StoragePath(FullDisk(free_bytes=8, match=fails), str(tmp_path))
    with pytest.raises(OSError) as info:
        lay, _, infos = write_all(root, 2, seed=2)  # the workers' writes
        infos.append(write_extra(root, 2, {"buf": torch.ones(8)}))
        commit(root, 2, {"layout": lay}, infos)  # the driver's manifest, then latest
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_00000001")
    assert not _no_temp_files(tmp_path), _no_temp_files(tmp_path)
    if fails != "latest":  # up to the manifest, step 2 never became a checkpoint
        assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    _loads_as_step_one(tmp_path, logical)


def test_storage_paths_keep_their_storage(tmp_path):
    disk = FullDisk(free_bytes=10**9)
    root = StoragePath(disk, str(tmp_path))
    lay, _, infos = write_all(root, 3)
    step = commit(root, 3, {"layout": lay}, infos)
    assert step == StoragePath(disk, str(tmp_path / "step_00000003")) and str(step) == str(tmp_path / "step_00000003")
    assert latest_checkpoint(root) == step and checkpoint_dir(root) == step
    assert list_checkpoints(root) == [(3, step)]
