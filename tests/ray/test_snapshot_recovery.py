"""In-memory snapshots ([Note: in-memory snapshots] in zeroray/runtime/snapshot.py): a worker
SIGKILLed mid-fit costs at most one step, and the run after recovery equals an uninterrupted run
bitwise (per-step losses and final weights). The recovery replaces the lost worker only ([Note:
replace, don't restart] in zeroray/runtime/worker_group/group.py): the survivor keeps its process, the
replacement is a new actor, or with ``FailureConfig(spares=1)`` the warm spare.

The kill lands as in test_faults.py: worker 1 blocks inside loss_fn of the step on a named batch,
says so, and only then is killed, so the machine's load cannot change which step fails. The disk
checkpoint is far behind (step 0), so the recovery must come from memory to redo at most one step.
A second fit loses its snapshot (one shard's object is gone, as when the node whose object store
held it dies) and
falls back to the disk checkpoint, still bitwise.
"""
import functools
import os
import signal
import threading

import pytest
import ray
import torch

import zeroray as zr
from zeroray.memory.model import snapshot_bytes
from tests.models import lm_loss, make_batches, parity_model
from tests.ray.test_faults import KillingData, actor_dead, pid_gone, wait_for, fingerprint, gated_loss
from tests.ray.user_dist import check_group, dist_view

STEPS = 8
MORE = 4      # the second fit's steps
KILL_AT = 5   # worker 1 dies inside the step on batch 5: five steps done, the snapshot of step 5 complete


def _trainer(gate_dir, ckpt_dir, stage, spares=0):
    return zr.Trainer(parity_model, functools.partial(gated_loss, str(gate_dir)),
                      optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=stage, collective_timeout_s=10.0),
                      scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=2, snapshot_every=1, spares=spares),
                      checkpoint=zr.CheckpointConfig(path=str(ckpt_dir)))


def _arm_kill(trainer, gate_dir, batch, before_kill=lambda: None):
    """Kill worker 1 while it is blocked in loss_fn on its half of ``batch``."""
    pid = trainer.workers[1]["pid"]
    target = fingerprint(batch[0][batch[0].shape[0] // 2:])
    landed = {}

    def arm():
        (gate_dir / "gate").write_text(f"{pid} {target}")

        def killer():
            wait_for((gate_dir / "blocked").exists, "worker 1 to block in loss_fn")
            landed["batch"] = (gate_dir / "blocked").read_text()
            before_kill()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: pid_gone(pid), "the killed worker's process to exit")
            (gate_dir / "gate").unlink()
            (gate_dir / "blocked").unlink()
        threading.Thread(target=killer, daemon=True).start()
    return arm, landed, target


@ray.remote
class _Owner:
    def put(self):
        return [ray.put(torch.zeros(1))]  # a ref inside a list stays owned by this actor


def _lose(snapshot):
    """Make worker 1's shard of ``snapshot`` a lost object for real (its owner is dead), as when the
    node whose object store held it died: fetching it raises OwnerDiedError."""
    owner = _Owner.remote()
    ref = ray.get(owner.put.remote())[0]
    ray.kill(owner)
    wait_for(lambda: actor_dead(owner, "put", timeout_s=5), "the owner to die")
    snapshot.shards[1] = ref


# Stage 1: the import is collective, so the two-phase restore matters; stage 3: parameters sharded
# too, taken over by a warm spare.
@pytest.mark.parametrize("stage,spares", [(1, 0), (3, 1)])
def test_sigkill_recovers_from_memory_bitwise(ray_local, tmp_path, stage, spares):
    batches = make_batches(STEPS + MORE)
    (tmp_path / "gate").mkdir()

    with _trainer(tmp_path / "gate", tmp_path / "ref_ckpt", stage) as trainer:  # uninterrupted
        ref = trainer.fit(batches[:STEPS], progress=False) + trainer.fit(batches[STEPS:], skip=0, progress=False)
        ref_state = trainer.state_dict()

    gate = tmp_path / "gate"
    with _trainer(gate, tmp_path / "ckpt", stage, spares) as trainer:
        trainer.save()  # step 0: the disk checkpoint is far behind the snapshot
        survivor = trainer.workers[0]["pid"]
        arm, landed, target = _arm_kill(trainer, gate, batches[KILL_AT])
        first = trainer.fit(KillingData(batches[:STEPS], KILL_AT, arm), progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        print(f"\n  stage {stage}: recovered from {rec['restored_from']} at step {rec['step']}, "
              f"{rec['redone_steps']} step(s) redone, restore {rec['restore_s']:.2f} s, recovery {rec['seconds']:.1f} s"
              f" ({rec['spares_used']} spare(s) used)")
        assert len(trainer.recoveries) == 1
        assert rec["restored_from"] == "memory" and rec["step"] == KILL_AT and rec["redone_steps"] <= 1, rec
        assert rec["mode"] == "replace" and rec["replaced"] == 1 and rec["spares_used"] == spares, rec
        assert trainer.workers[0]["pid"] == survivor  # kept its process
        assert [w["rank"] for w in trainer.workers] == [0, 1]
        check_group(trainer.run(dist_view), 2)  # torch.distributed's default group formed again, the new worker in it

        # What a snapshot costs, where a user reads memory figures: this rank's state shard.
        report = trainer.memory_report()
        assert all(r["snapshot_bytes"] > 0 for r in report)
        # The estimator counts it: the fp32 master and AdamW's two moments of the shard.
        estimate = snapshot_bytes(report[0]["num_params"], 2, "adamw", padded_numel=report[0]["padded_numel"])
        assert [r["snapshot_bytes"] for r in report] == [estimate] * 2, (report, estimate)
        print(f"  snapshot bytes per worker: {[r['snapshot_bytes'] for r in report]}")

        # Second fit: the snapshot is lost before the kill, so recovery falls back to the disk
        # checkpoint of step STEPS and redoes the steps since.
        trainer.save()
        def newest():  # the second fit's keeper (each fit makes a new one)
            return trainer.controller.snapshots.complete

        def lose_newest():  # the snapshot of step STEPS + 2, once the driver collected that step
            wait_for(lambda: newest() is not None and newest().step == STEPS + 2,
                     "the snapshot of the step before the kill to be complete")
            _lose(newest())
        arm, landed, target = _arm_kill(trainer, gate, batches[STEPS + 2], before_kill=lose_newest)
        second = trainer.fit(KillingData(batches[STEPS:], 2, arm), skip=0, progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        print(f"  after the snapshot was lost: restored from {rec['restored_from']} at step {rec['step']}, "
              f"{rec['redone_steps']} step(s) redone; lost: {rec.get('snapshot_lost', '')[:200]}")
        assert len(trainer.recoveries) == 2
        assert rec["restored_from"] == "disk" and rec["step"] == STEPS and "snapshot_lost" in rec, rec
        assert rec["mode"] == "replace" and trainer.workers[0]["pid"] == survivor, rec
        state = trainer.state_dict()

    results = first + second
    assert [r.step for r in results] == [r.step for r in ref] == list(range(1, STEPS + MORE + 1))
    assert [r.loss for r in results] == [r.loss for r in ref]  # bitwise
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref]
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), \
        {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state if not torch.equal(state[k], ref_state[k])}


def test_failure_config_snapshot_every():
    assert zr.FailureConfig().snapshot_every is None
    assert zr.FailureConfig(max_failures=1, snapshot_every=3).snapshot_every == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"FailureConfig\.snapshot_every=.* is invalid: .*integer >= 1.*None"):
            zr.FailureConfig(snapshot_every=bad)
    assert zr.FailureConfig(snapshot_every=1, spares=1).spares == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"FailureConfig\.spares=.* is invalid: .*integer >= 0"):
            zr.FailureConfig(snapshot_every=1, spares=bad)
    with pytest.raises(ValueError, match=r"FailureConfig\.spares=1 is invalid: .*set snapshot_every"):
        zr.FailureConfig(spares=1)
