"""Which spare a replacement takes ([Note: replace, don't restart] in
zeroray/runtime/worker_group/reform.py): a spare that died after it warmed (its process SIGKILLed)
is dropped, not put in the lost rank, so the recovery costs one failure, not two (with
``max_failures=1`` taking the dead spare would end the fit), and the lost rank gets a new actor.
"""
import functools
import os
import signal

import ray

import zeroray as zr
from tests.models import make_batches, parity_model
from tests.ray.test_faults import KillingData, gated_loss, pid_gone, wait_for
from tests.ray.test_snapshot_recovery import _arm_kill

STEPS = 5
KILL_AT = 3


def test_a_dead_spare_is_dropped_not_taken(ray_local, tmp_path):
    batches = make_batches(STEPS)
    gate = tmp_path / "gate"
    gate.mkdir()
    with zr.Trainer(parity_model, functools.partial(gated_loss, str(gate)), optimizer=zr.AdamW(lr=1e-2),
                    zero=zr.ZeroConfig(stage=1, collective_timeout_s=10.0), scaling=zr.ScalingConfig(num_workers=2),
                    failure=zr.FailureConfig(max_failures=1, snapshot_every=1, spares=1)) as trainer:
        group = trainer.controller.group
        assert group.spares_warm(120)
        spare_pid = ray.get(group.spares[0][0].node_info.remote())["pid"]
        os.kill(spare_pid, signal.SIGKILL)
        wait_for(lambda: pid_gone(spare_pid), "the spare's process to exit")
        survivor = trainer.workers[0]["pid"]
        arm, landed, target = _arm_kill(trainer, gate, batches[KILL_AT])
        results = trainer.fit(KillingData(batches, KILL_AT, arm), progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        print(f"\n  recovered in {rec['seconds']:.1f} s: {rec['spares_used']} spare(s) used, "
              f"from {rec['restored_from']}")
        assert len(trainer.recoveries) == 1
        assert rec["mode"] == "replace" and rec["spares_used"] == 0 and rec["restored_from"] == "memory", rec
        assert trainer.workers[0]["pid"] == survivor
        assert spare_pid not in [w["pid"] for w in trainer.workers]
        assert [r.step for r in results] == list(range(1, STEPS + 1))
