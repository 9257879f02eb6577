"""offload="disk" through the Trainer: the workers' optimizer state in files under offload_dir;
save at 2 workers (stage 3), restore at 3 (stage 2), resize in place 3 -> 2: the run equals uninterrupted single-process PyTorch within 1e-5, as without offload
(tests/ray/test_checkpoint_resize.py). In bf16 (the fp32 master on disk too, [Note: master on
disk] in zeroray/offload/master.py) the save at 2 workers and the restore at 3, both at stage 3
with the parameter shard on disk ([Note: parameter shard on disk] in zeroray/offload/shard.py),
equal the same without offload bitwise.
A worker SIGKILLed mid-fit with the master and state on disk recovers, from the disk checkpoint
(the group restarts) or from an in-memory snapshot (the survivor keeps its process and its
files, which the snapshot's import overwrites), and the run equals the uninterrupted one
without offload bitwise. The files are scratch: the checkpoint
holds the state. An offload_dir that cannot hold the files fails the Trainer's start with a
clear error."""
import functools
import os

import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model
from tests.ray.test_checkpoint_resize import OPT, SPLIT, check, reference  # noqa: F401 (fixture)
from tests.ray.test_faults import KillingData, gated_loss
from tests.ray.test_snapshot_recovery import _arm_kill


def _zero(folder, stage=3):
    return zr.ZeroConfig(stage=stage, offload="disk", offload_dir=str(folder), offload_chunk_bytes=512)


def test_offload_save_restore_and_resize(ray_local, reference, tmp_path):
    batches, ref = reference
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = str(tmp_path / "ckpt")
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(scratch),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        for b in batches[:SPLIT]:
            trainer.step(b)
        trainer.save(root)
    assert os.listdir(scratch) == []  # the workers' files are unlinked while open: nothing is left
    with zr.Trainer.restore(root, parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(scratch, stage=2),
                            scaling=zr.ScalingConfig(num_workers=3)) as restored:
        results = [restored.step(b) for b in batches[SPLIT:SPLIT + 2]]
        restored.resize(2)
        results += [restored.step(b) for b in batches[SPLIT + 2:]]
        worst = check(restored, results, ref, SPLIT)
        print(f"save at 2 workers, restore at 3, resize to 2, all with offload: max param diff {worst:.2e}")
    assert os.listdir(scratch) == []


def test_unusable_offload_dir_fails_the_start(ray_local, tmp_path):
    blocker = tmp_path / "a_file"  # a path under a regular file: no directory can be made there, even as root
    blocker.write_text("")
    with pytest.raises(Exception, match=r"offload_dir .*a_file.* cannot be used .*Not a directory") as info:
        zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(blocker / "offload"),
                   scaling=zr.ScalingConfig(num_workers=2))
    print(type(info.value).__name__, str(info.value)[:300])


def _save_restore(batches, root, zero):
    """Save at 2 workers, restore at 3, both stage 3: every step's result and the final
    state_dict. (Resize moves the state the same way a restore does; the fp32 test above covers
    it with offload, and the restore into stage 2.)"""
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zero(3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        results = [trainer.step(b) for b in batches[:SPLIT]]
        trainer.save(root)
    with zr.Trainer.restore(root, parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zero(3),
                            scaling=zr.ScalingConfig(num_workers=3)) as restored:
        results += [restored.step(b) for b in batches[SPLIT:]]
        return results, restored.state_dict()


def test_bf16_master_on_disk_save_restore_equals_memory(ray_local, reference, tmp_path):
    batches, _ = reference
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    in_memory = lambda stage: zr.ZeroConfig(stage=stage, dtype="bf16")
    on_disk = lambda stage: zr.ZeroConfig(stage=stage, dtype="bf16", offload="disk", offload_dir=str(scratch),
                                          offload_chunk_bytes=512)
    want, want_sd = _save_restore(batches, str(tmp_path / "mem"), in_memory)
    got, got_sd = _save_restore(batches, str(tmp_path / "disk"), on_disk)
    assert [r.loss for r in got] == [r.loss for r in want] and [r.grad_norm for r in got] == [r.grad_norm for r in want]
    worst = max((got_sd[k] - v).abs().max().item() for k, v in want_sd.items())
    print(f"bf16 stage 3, shard, master and state on disk: save at 2, restore at 3: max diff to in-memory {worst:.1e}")
    assert all(torch.equal(got_sd[k], v) for k, v in want_sd.items())
    assert os.listdir(scratch) == []


KILL_STEPS, KILL_AT, EVERY = 8, 5, 2


def _killable(gate_dir, ckpt_dir, snapshot=False, **offload):
    failure = zr.FailureConfig(max_failures=1, snapshot_every=1 if snapshot else None)
    return zr.Trainer(parity_model, functools.partial(gated_loss, str(gate_dir)), optimizer=zr.AdamW(**OPT),
                      zero=zr.ZeroConfig(stage=3, dtype="bf16", collective_timeout_s=10.0, **offload),
                      scaling=zr.ScalingConfig(num_workers=2), failure=failure,
                      checkpoint=zr.CheckpointConfig(path=str(ckpt_dir), every_steps=EVERY, keep=2))


@pytest.fixture(scope="module")
def uninterrupted(ray_local, tmp_path_factory):
    """The bf16 stage-3 run without offload and without failures: results and state_dict."""
    batches = make_batches(KILL_STEPS)
    root = tmp_path_factory.mktemp("uninterrupted")
    (root / "gate").mkdir()
    with _killable(root / "gate", root / "ckpt") as trainer:
        return batches, trainer.fit(batches, progress=False), trainer.state_dict()


# Without snapshots the group restarts from the disk checkpoint of step 4; with them the lost
# worker alone is replaced and the survivor, which keeps its process and its files, imports the
# snapshot of step 5 over them.
@pytest.mark.parametrize("snapshot", [False, True])
def test_sigkill_with_offload_recovers_bitwise(ray_local, uninterrupted, tmp_path, snapshot):
    """Worker 1 dies inside step 6 (bf16, stage 3: master and Adam state on disk); the run
    equals the uninterrupted one without offload, bitwise."""
    batches, ref, ref_state = uninterrupted
    gate = tmp_path / "gate"
    gate.mkdir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with _killable(gate, tmp_path / "ckpt", snapshot, offload="disk", offload_dir=str(scratch),
                   offload_chunk_bytes=512) as trainer:
        survivor = trainer.workers[0]["pid"]
        arm, landed, target = _arm_kill(trainer, gate, batches[KILL_AT])
        results = trainer.fit(KillingData(batches, KILL_AT, arm), progress=False)
        assert landed == {"batch": target}, landed
        assert len(trainer.recoveries) == 1
        rec = trainer.recoveries[0]
        print(f"\n  offload='disk', bf16 stage 3: recovered from {rec['restored_from']} at step {rec['step']}, "
              f"{rec.get('redone_steps')} step(s) redone, mode {rec.get('mode')}")
        if snapshot:
            assert rec["restored_from"] == "memory" and rec["step"] == KILL_AT and rec["mode"] == "replace", rec
            assert trainer.workers[0]["pid"] == survivor  # kept its process and its files
        else:
            assert rec["restored_from"] == "disk" and rec["step"] == 4, rec
        state = trainer.state_dict()
    assert [r.step for r in results] == [r.step for r in ref] == list(range(1, KILL_STEPS + 1))
    assert [r.loss for r in results] == [r.loss for r in ref]
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref]
    worst = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    print(f"  max |param - uninterrupted in memory| = {worst:.1e}")
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())
    assert os.listdir(scratch) == []
