"""[Note: overlapped snapshot copy] (zeroray/runtime/snapshot.py): a snapshot's copy runs after
its turn, beside the next step's forward and backward, and that step's update waits for it. A
worker SIGKILLed inside the copy leaves the snapshot before it the complete one, never a half
copy: the recovery loads that one, redoes one step, and the run equals an uninterrupted run
bitwise (per-step losses and final weights).

The copy is stopped where it reads the LR scheduler's state (``export_state`` does, beside the
next step): ``GatedLR`` blocks the process named in ``gate_dir/copy_gate`` when its step count
is the one named there, says so in ``gate_dir/copy_blocked``, and waits to be killed.
"""
import functools
import os
import signal
import threading
import time

import ray
import torch

import zeroray as zr
from tests.models import make_batches, parity_model
from tests.ray.test_faults import pid_gone, slow_rank_loss, wait_for

STEPS = 6
KILL_IN_COPY_OF = 3  # worker 1 dies copying the snapshot of step 3: the snapshot of step 2 stays complete


class GatedLR(torch.optim.lr_scheduler.LambdaLR):
    """A constant learning rate whose ``state_dict`` blocks at a gate (see the module docstring)."""

    def __init__(self, optimizer, gate_dir):
        self.gate_dir = gate_dir
        super().__init__(optimizer, lambda step: 1.0)

    def state_dict(self):
        gate = os.path.join(self.gate_dir, "copy_gate")
        if os.path.exists(gate) and open(gate).read().split() == [str(os.getpid()), str(self.last_epoch)]:
            with open(os.path.join(self.gate_dir, "copy_blocked.tmp"), "w") as f:
                f.write(str(self.last_epoch))
            os.replace(os.path.join(self.gate_dir, "copy_blocked.tmp"), os.path.join(self.gate_dir, "copy_blocked"))
            time.sleep(300)  # the test SIGKILLs this process long before
        return super().state_dict()


def _trainer(gate_dir, ckpt_dir):
    return zr.Trainer(parity_model, slow_rank_loss, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=3, collective_timeout_s=10.0), scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=2, snapshot_every=1),
                      checkpoint=zr.CheckpointConfig(path=str(ckpt_dir)),
                      scheduler=functools.partial(GatedLR, gate_dir=str(gate_dir)))


def test_sigkill_inside_the_snapshot_copy_keeps_the_one_before(ray_local, tmp_path):
    batches = make_batches(STEPS)
    gate = tmp_path / "gate"
    gate.mkdir()
    with _trainer(gate, tmp_path / "ref_ckpt") as trainer:  # uninterrupted
        ref = trainer.fit(batches, progress=False)
        ref_state = trainer.state_dict()

    with _trainer(gate, tmp_path / "ckpt") as trainer:
        trainer.save()  # step 0: the disk checkpoint is far behind the snapshots
        pid = trainer.workers[1]["pid"]
        (gate / "copy_gate").write_text(f"{pid} {KILL_IN_COPY_OF}")

        seen = {}

        def killer():
            wait_for((gate / "copy_blocked").exists, "worker 1 to block inside the snapshot copy")
            # Overlapped: worker 1's next step ran its forward and backward beside the copy (so
            # worker 0, which met it in their collectives, applied that step), and its update
            # waits for the copy (worker 1's step count is still the snapshot's).
            group = trainer.controller.group
            wait_for(lambda: ray.get(group.poll("progress", ranks=[0]))[0]["step"] == KILL_IN_COPY_OF + 1,
                     "worker 0 to apply the step after the snapshot", timeout_s=60)
            seen.update(ray.get(group.poll("progress", ranks=[1]))[0])
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: pid_gone(pid), "the killed worker's process to exit")
            (gate / "copy_gate").unlink()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        results = trainer.fit(batches, progress=False)
        thread.join(60)
        assert (gate / "copy_blocked").read_text() == str(KILL_IN_COPY_OF)
        assert seen["step"] == KILL_IN_COPY_OF, seen
        rec = trainer.recoveries[-1]
        print(f"\n  killed inside the copy of step {KILL_IN_COPY_OF}: restored from {rec['restored_from']} at "
              f"step {rec['step']}, {rec['redone_steps']} step(s) redone")
        assert len(trainer.recoveries) == 1
        assert rec["restored_from"] == "memory" and rec["step"] == KILL_IN_COPY_OF - 1, rec
        assert rec["redone_steps"] == 1, rec
        state = trainer.state_dict()

    assert [r.step for r in results] == [r.step for r in ref] == list(range(1, STEPS + 1))
    assert [r.loss for r in results] == [r.loss for r in ref]  # bitwise
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref]
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), \
        {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state if not torch.equal(state[k], ref_state[k])}
