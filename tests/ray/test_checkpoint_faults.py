"""Bad storage and bad checkpoints with real workers.

- A full disk during a save inside fit (zeroray.checkpoint.faults.FullDisk, reached through a
  StoragePath by the worker that writes the file): fit stops with the OSError and a note saying
  what was kept; ``latest`` still names the previous checkpoint, which loads with the weights of
  its step; the workers were not torn down, and once the storage works fit goes on and ends
  with the weights of an uninterrupted run ([Note: failed saves] in runtime/controller/checkpointing.py).
- ``Trainer.restore(root, ..., fallback=True)`` skips damaged checkpoints (a flipped byte in a
  shard, a manifest that is not JSON, an interrupted save) and loads the newest one that
  verifies, saying which it skipped and why.
"""
import errno
import logging
import shutil

import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run
from zeroray.checkpoint import CheckpointError, StoragePath, full_state_dict, latest_checkpoint
from zeroray.checkpoint.faults import FullDisk

OPT = dict(lr=1e-2, weight_decay=0.1)
STEPS = 6


@pytest.fixture(scope="module")
def reference():
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)  # noqa: E731
    return batches, {n: reference_run(parity_model, lm_loss, make_opt, batches[:n])[2] for n in (2, 4, STEPS)}


def _worst(state, want):
    return max((state[k] - v).abs().max().item() for k, v in want.items())


def _trainer(path, every_steps=2, keep=5):
    return zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3),
                      scaling=zr.ScalingConfig(num_workers=2),
                      checkpoint=zr.CheckpointConfig(path=path, every_steps=every_steps, keep=keep))


def test_a_full_disk_during_a_save_stops_fit_and_keeps_latest(ray_local, reference, tmp_path):
    batches, want = reference
    root = tmp_path / "ckpt"
    # Worker 1 runs out of space 64 bytes into its shard of step 4; step 2 saves normally.
    disk = FullDisk(free_bytes=64, match="step_00000004/shard_00001")
    with _trainer(StoragePath(disk, str(root))) as trainer:
        pids = [w["pid"] for w in trainer.workers]
        with pytest.raises(OSError) as info:
            trainer.fit(batches, progress=False)
        error = info.value
        notes = "\n".join(getattr(error, "__notes__", []))
        print(f"\n  {type(error).__name__}: {error}\n  {notes}")
        assert error.errno == errno.ENOSPC and "shard_00001" in str(error)
        assert "raised on worker 1" in notes and "during save" in notes
        assert f"{root / 'step_00000002'} is still the latest checkpoint and loads" in notes
        # Nothing of step 4 was committed; step 2 is latest and holds the weights of step 2.
        assert (root / "latest").read_text().strip() == "step_00000002"
        assert latest_checkpoint(root) == str(root / "step_00000002")
        assert not (root / "step_00000004" / "manifest.json").exists()
        assert _worst(full_state_dict(root / "step_00000002"), want[2]) <= 1e-5
        # The trainer still holds step 4 on the same workers: with working storage, fit goes on.
        assert (trainer.step_count, trainer.data_position, trainer.state.value) == (4, 4, "idle")
        assert [w["pid"] for w in trainer.workers] == pids
        trainer.checkpoint_config = zr.CheckpointConfig(path=str(root), every_steps=2, keep=5)
        rest = trainer.fit(batches, progress=False)
        assert [r.step for r in rest] == [5, 6]
        assert _worst(trainer.state_dict(), want[STEPS]) <= 1e-5
        assert latest_checkpoint(root) == str(root / "step_00000006")


def test_restore_with_fallback_loads_the_newest_checkpoint_that_verifies(ray_local, reference, tmp_path, caplog):
    batches, want = reference
    root = tmp_path / "ckpt"
    with _trainer(str(root), keep=10) as trainer:
        trainer.fit(batches, progress=False)  # checkpoints at steps 2, 4 and 6
    # Step 6: a flipped byte in a shard. Step 4: a manifest that is not JSON. Step 8: an interrupted save.
    shard = root / "step_00000006" / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    (root / "step_00000004" / "manifest.json").write_text("{not json")
    shutil.copytree(root / "step_00000002", root / "step_00000008")
    (root / "step_00000008" / "manifest.json").unlink()

    with pytest.raises(CheckpointError, match="is corrupted: sha256"):  # without fallback: the damage, as it is
        zr.Trainer.restore(str(root / "step_00000006"), parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2))
    caplog.set_level(logging.WARNING, logger="zeroray")
    with zr.Trainer.restore(str(root), parity_model, lm_loss, fallback=True, optimizer=zr.AdamW(**OPT),
                            zero=zr.ZeroConfig(stage=3), scaling=zr.ScalingConfig(num_workers=2)) as restored:
        skipped = [(s.path, s.reason) for s in restored.skipped_checkpoints]
        print("\n  skipped:\n  " + "\n  ".join(f"{p}: {r}" for p, r in skipped))
        assert restored.restored_from == str(root / "step_00000002") and restored.step_count == 2
        assert [p for p, _ in skipped] == [str(root / f"step_0000000{s}") for s in (8, 6, 4)]
        assert "no manifest.json" in skipped[0][1]
        assert "is corrupted: sha256" in skipped[1][1] and "shard_00000" in skipped[1][1]
        assert "not valid JSON" in skipped[2][1]
        logged = [r.getMessage() for r in caplog.records if r.name == "zeroray"]
        assert sum("restore skipped" in m for m in logged) == 3
        # It continues as an uninterrupted run would.
        restored.fit(batches, progress=False)
        assert restored.step_count == STEPS
        assert _worst(restored.state_dict(), want[STEPS]) <= 1e-5
    with pytest.raises(CheckpointError, match="no checkpoint there verifies"):
        shutil.rmtree(root / "step_00000002")
        zr.Trainer.restore(str(root), parity_model, lm_loss, fallback=True, scaling=zr.ScalingConfig(num_workers=2))
