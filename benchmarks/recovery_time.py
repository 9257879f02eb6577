"""Where one recovery's time goes: a worker SIGKILLed inside a step of fit, with in-memory
snapshots after every step (``FailureConfig(snapshot_every=1)``), on the tests' small model.

    PYTHONPATH=$PWD python benchmarks/recovery_time.py --stage 1 --repeats 3

Worker 1 blocks in loss_fn on a named batch (tests/ray/test_faults.py's gate), is killed there,
and the script prints, per recovery, the seconds from the kill to the failure being detected
and then each phase of the recovery record (``trainer.recoveries``), and the steps redone.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import ray  # noqa: E402

import zeroray as zr  # noqa: E402
from tests.models import make_batches, parity_model  # noqa: E402
from tests.ray.test_faults import KillingData, gated_loss  # noqa: E402
from tests.ray.test_snapshot_recovery import _arm_kill  # noqa: E402

KILL_AT = 5


def one_recovery(stage: int, workers: int, spares: int, gate_dir) -> dict:
    batches = make_batches(KILL_AT + 3)
    failure = zr.FailureConfig(max_failures=2, snapshot_every=1, **({"spares": spares} if spares else {}))
    with zr.Trainer(parity_model, functools.partial(gated_loss, str(gate_dir)),
                    optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                    zero=zr.ZeroConfig(stage=stage, collective_timeout_s=10.0),
                    scaling=zr.ScalingConfig(num_workers=workers), failure=failure) as trainer:
        if spares:  # as in a long run: the spare started and warmed long before the failure
            trainer.controller.group.spares_warm(120)
        killed = {}
        arm, _, _ = _arm_kill(trainer, gate_dir, batches[KILL_AT],
                              before_kill=lambda: killed.setdefault("at", time.monotonic()))
        trainer.fit(KillingData(batches, KILL_AT, arm), progress=False)
        rec = dict(trainer.recoveries[-1])
    rec["kill_to_detect_s"] = rec["detected_at"] - killed["at"]
    rec["kill_to_resume_s"] = rec["resumed_at"] - killed["at"]
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    gate = tempfile.mkdtemp(prefix="zr-rec-")
    from pathlib import Path

    for i in range(args.repeats):
        rec = one_recovery(args.stage, args.workers, args.spares, Path(gate))
        keys = [k for k, v in rec.items() if isinstance(v, float) and k.endswith("_s")] + ["seconds"]
        print(f"recovery {i}: " + ", ".join(f"{k} {rec[k]:.2f}" for k in keys)
              + f"; from {rec['restored_from']}, {rec['redone_steps']} step(s) redone", flush=True)
        print("RECOVERY " + json.dumps({k: v for k, v in rec.items() if k != "cause"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
