"""A replacement that dies, or stalls, while the group is re-formed ([Note: rendezvous timeout] in
zeroray/runtime/worker_group/reform.py): the survivor waits in the rendezvous only until its own short
timeout, stays alive with its process, and the driver re-forms again: with another replacement
after a death, with the same workers after a stall. One recovery (two attempts, two failures
counted), the survivor's pid unchanged, at most one step redone, losses and weights bitwise equal
to an uninterrupted run.

The faults land as chaos's "replacement killed during re-form" does (benchmarks/chaos.py's
``_kill_replacement``): worker 1 blocks in loss_fn on a named batch and is SIGKILLed there; the
new worker that takes rank 1 is SIGKILLed (or SIGSTOPped for longer than the rendezvous timeout,
then resumed: a loaded machine) as soon as it shows up in ``trainer.workers``, which is when its
setup call, and with it the rendezvous, starts.
"""
import functools
import os
import signal
import threading
import time

import pytest
import torch

import zeroray as zr
from tests.models import make_batches, parity_model
from tests.ray.test_faults import KillingData, gated_loss, pid_gone, wait_for
from tests.ray.test_snapshot_recovery import _arm_kill

STEPS = 5
KILL_AT = 3
_REFERENCE = {}


def _trainer(gate_dir):
    return zr.Trainer(parity_model, functools.partial(gated_loss, str(gate_dir)),
                      optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=1, collective_timeout_s=30.0),
                      scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=2, snapshot_every=1))


def _reference(gate_dir, batches):
    if not _REFERENCE:  # the uninterrupted run, once for both faults
        with _trainer(gate_dir) as trainer:
            _REFERENCE["results"] = trainer.fit(batches, progress=False)
            _REFERENCE["state"] = trainer.state_dict()
    return _REFERENCE["results"], _REFERENCE["state"]


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_replacement_lost_during_reform_keeps_the_survivor(ray_local, tmp_path, fault):
    batches = make_batches(STEPS)
    gate = tmp_path / "gate"
    gate.mkdir()
    ref, ref_state = _reference(gate, batches)

    with _trainer(gate) as trainer:
        known = {w["pid"] for w in trainer.workers}
        survivor = trainer.workers[0]["pid"]
        hit = {}

        def strike_replacement():
            def replacement():
                try:
                    workers = trainer.workers
                except RuntimeError:  # between groups
                    return None
                pid = workers[1]["pid"] if len(workers) > 1 else None
                return pid if pid not in known else None
            wait_for(lambda: replacement() is not None, "a replacement in rank 1")
            hit["pid"] = pid = replacement()
            if fault == "kill":
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: pid_gone(pid), "the replacement's process to exit")
            else:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(2 * trainer.controller.group.rendezvous_timeout_s + 1)  # the survivor gave up
                os.kill(pid, signal.SIGCONT)

        arm, landed, target = _arm_kill(trainer, gate, batches[KILL_AT],
                                        before_kill=lambda: threading.Thread(target=strike_replacement,
                                                                             daemon=True).start())
        results = trainer.fit(KillingData(batches, KILL_AT, arm), progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        print(f"\n  replacement pid {hit.get('pid')} {fault}ed during the re-form; recovered in {rec['seconds']:.1f} s "
              f"({rec.get('attempts')} attempts, mode {rec['mode']}, rendezvous timeout "
              f"{trainer.controller.group.rendezvous_timeout_s:g} s), {rec['redone_steps']} step(s) redone; "
              f"the last re-form's rendezvous {rec['rendezvous_s']:.2f} s")
        print("  " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                               if k not in ("cause", "detected_at", "resumed_at"))[:600])
        print(f"  cause: {rec['cause'][:300]}")
        assert len(trainer.recoveries) == 1
        assert rec["attempts"] == 2 and "re-form the group" in rec["cause"], rec  # it landed in the re-form
        assert rec["mode"] == "replace" and rec["restored_from"] == "memory" and rec["redone_steps"] <= 1, rec
        assert trainer.workers[0]["pid"] == survivor  # the survivor kept its process both times
        if fault == "kill":
            assert trainer.workers[1]["pid"] not in known | {hit["pid"]}
        else:  # nobody died; the stalled replacement is kept too, unless it answered after the driver's grace
            assert "rendezvous_timeout_s" in rec["cause"], rec
            print(f"  the stalled replacement was {'kept' if trainer.workers[1]['pid'] == hit['pid'] else 'replaced'}")
        state = trainer.state_dict()

    assert [r.step for r in results] == [r.step for r in ref] == list(range(1, STEPS + 1))
    assert [r.loss for r in results] == [r.loss for r in ref]  # bitwise
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref]
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), \
        {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state if not torch.equal(state[k], ref_state[k])}
