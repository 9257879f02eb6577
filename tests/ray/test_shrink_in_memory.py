"""Shrink in memory ([Note: shrink in memory] in zeroray/runtime/worker_group/reform.py): 3 workers of
2 CPUs fill a 3-node cluster of 2 CPUs a node; the node of one worker dies inside a step, so
its replacement cannot be placed. With ``min_workers=2`` the two survivors keep their processes,
re-form a group of two (torch.distributed's default group too), load the in-memory snapshot
(the lost rank's shard from its buddy's copy on another node) and train on, with at most the
failed step redone. The losses and final
weights equal, bitwise, those of an uninterrupted run resized 3 -> 2 at the step of the snapshot.

The cluster is ``ray.cluster_utils.Cluster`` (nodes as processes on this machine, one removable),
so the scenario runs in a subprocess of its own (this file run as a module): the session's
``ray_local`` stays as it is. The kill lands as in test_faults.py: the victim blocks inside
loss_fn of the step on a named batch, says so, and only then is its node removed.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "SHRINK_REPORT "
STEPS = 6
KILL_AT = 3  # the victim's node dies inside the step on batch 3: the snapshot of step 3 is complete


@pytest.mark.slow
def test_a_lost_node_without_room_shrinks_to_the_survivors_in_memory():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "tests.ray.test_shrink_in_memory"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARKER)]
    assert lines, f"no report (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    report = json.loads(lines[-1][len(MARKER):])
    print(report)
    rec = report["recovery"]
    assert rec["mode"] == "shrink" and rec["num_workers"] == 2 and rec["restored_from"] == "memory", rec
    assert rec["step"] == KILL_AT and rec["redone_steps"] <= 1, rec
    assert report["survivors_kept"], report
    assert report["steps"] == list(range(1, STEPS + 1)), report
    assert report["losses"] == report["reference_losses"]  # bitwise
    assert report["max_abs_diff"] == 0.0, report
    # torch.distributed's default group was formed again on the survivors: ranks 0-1 of 2
    assert report["dist_after"] == [[0, 2, 3.0], [1, 2, 3.0]], report


def _main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    import zeroray as zr
    from tests.models import make_batches, parity_model
    from tests.ray.test_faults import KillingData, fingerprint, gated_loss, wait_for
    from tests.ray.user_dist import dist_view

    store = 80 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": store})
    nodes = [cluster.add_node(num_cpus=2, object_store_memory=store) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    gate = tempfile.mkdtemp(prefix="zr-shrink-")
    loss = functools.partial(gated_loss, gate)
    batches = make_batches(STEPS)

    def trainer(cpus, **kwargs):
        # threads_per_worker=1 in both runs: the thread count may change torch's summation order.
        return zr.Trainer(parity_model, loss, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                          zero=zr.ZeroConfig(stage=3, collective_timeout_s=30.0),
                          scaling=zr.ScalingConfig(num_workers=3, cpus_per_worker=cpus, threads_per_worker=1,
                                                   placement_strategy="SPREAD", min_workers=2,
                                                   placement_timeout_s=5.0), **kwargs)

    try:
        # A replacement Ray schedules onto the dying node before Ray declares it dead dies with it: one
        # more failure, within the same recovery.
        with trainer(2, failure=zr.FailureConfig(max_failures=3, snapshot_every=1)) as run:
            head = ray.get_runtime_context().get_node_id()
            victim = next(w for w in run.workers if w["node_id"] != head)
            node = next(n for n in nodes if n.node_id == victim["node_id"])
            survivors = {w["pid"] for w in run.workers} - {victim["pid"]}
            rows = slice(4 * victim["rank"], 4 * victim["rank"] + 4)  # its third of the 12 rows
            target = fingerprint(batches[KILL_AT][0][rows])

            def arm():
                with open(os.path.join(gate, "gate"), "w") as f:
                    f.write(f"{victim['pid']} {target}")

                def killer():
                    wait_for(lambda: os.path.exists(os.path.join(gate, "blocked")), "the victim to block in loss_fn")
                    time.sleep(2.0)  # the buddy's copy of the last snapshot is taken beside this step
                    cluster.remove_node(node, allow_graceful=False)
                    os.unlink(os.path.join(gate, "gate"))
                threading.Thread(target=killer, daemon=True).start()

            results = run.fit(KillingData(batches, KILL_AT, arm), progress=False)
            rec = {k: v for k, v in run.recoveries[-1].items() if isinstance(v, (int, float, str))}
            kept = survivors == {w["pid"] for w in run.workers}
            state = run.state_dict()
            dist_after = [(v["rank"], v["world"], v["sum"]) for v in run.run(dist_view)]
        with trainer(0.5) as ref:  # 4 CPUs left: 3 + 2 workers of half a CPU beside each other
            ref_losses = [r.loss for r in ref.fit(batches, num_steps=KILL_AT, progress=False)]
            ref.resize(2)
            ref_losses += [r.loss for r in ref.fit(batches, progress=False)]  # from data position KILL_AT
            ref_state = ref.state_dict()
        diff = max(float((state[k].float() - ref_state[k].float()).abs().max()) for k in ref_state)
        print(MARKER + json.dumps({"recovery": rec, "survivors_kept": kept, "steps": [r.step for r in results],
                                   "losses": [r.loss for r in results], "reference_losses": ref_losses,
                                   "max_abs_diff": diff, "same_keys": state.keys() == ref_state.keys(),
                                   "dist_after": dist_after}),
              flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _main()
