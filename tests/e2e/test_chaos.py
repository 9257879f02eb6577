"""Nothing lost, nothing hangs, on a local 3-node cluster (cluster/local-cluster.sh):

- the driver is SIGKILLed inside a step: every worker actor, the placement group and the worker
  processes are gone within seconds (polled from a second driver on the same cluster), and
  ``Trainer.restore`` from the checkpoint goes on to the weights of an uninterrupted run
  (benchmarks/driver_death.py);
- the short chaos run: a SIGKILL inside a step, one inside a save, a lost node, a hung worker, on
  one training run; it ends with the weights of an uninterrupted run, every checkpoint ``latest``
  named loads and holds the weights of its step, and nothing is left (benchmarks/chaos.py; the
  long run is ``python benchmarks/chaos.py --cycles 50``).

Both scripts run as subprocesses (their own drivers, with the cluster's token), so nothing of the
cluster's Ray state reaches this pytest process; the cluster is started once for both (and for
test_elastic_resume.py after them: tests/e2e/conftest.py), and ``local-cluster.sh down`` must find
nothing left of it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local-cluster.sh needs Linux"),
    pytest.mark.skipif(shutil.which("setsid") is None, reason="local-cluster.sh needs setsid"),
]


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster


def _run(script: str, cluster: LocalCluster, *args: str, marker: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script),
                          "--cluster", f"{cluster.dir}:{cluster.head_port}:{cluster.dashboard_port}", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith(marker)]
    print(out.stdout[-6000:])
    assert lines, f"no report (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len(marker):])


def test_driver_killed_mid_fit_releases_everything_and_restore_goes_on(cluster):
    report = _run("driver_death.py", cluster, "--steps", "8", "--kill-at", "5", marker="DRIVER_DEATH_REPORT ",
                  timeout=400)
    assert report["ok"], report
    assert report["seconds_until_no_actor"] < 10 and report["seconds_until_placement_group_removed"] < 10
    assert report["seconds_until_worker_processes_gone"] < 20
    assert report["restored_at_step"] == 4 and report["final_max_abs_diff"] <= 1e-6


def test_short_chaos_run_loses_nothing(cluster):
    report = _run("chaos.py", cluster, "--cycles", "4", "--seed", "1", "--kinds", "step-kill,save-kill,node-loss,hang",
                  "--collective-timeout", "5", marker="CHAOS_REPORT ", timeout=600)
    assert report["ok"], report
    assert report["faults_injected"] == report["faults_survived"] == 4
    assert report["by_kind"] == {"step-kill": 1, "save-kill": 1, "node-loss": 1, "hang": 1}
    assert report["final_max_abs_diff"] <= 1e-6 and report["checkpoint_max_abs_diff"] <= 1e-6
    assert report["checkpoints_verified"] >= 4 and not any(report["leftovers"].values())
