"""Run examples/tune_lr.py's sweep with the given arguments as a driver of the Ray cluster that
RAY_ADDRESS names, then check the cluster from here, while this driver's job still exists (Ray's
state API; the cluster runs the dashboard it needs):

- placement: every zeroray worker actor of the run ran in a trial's placement group, and each
  trial's placement group (one per start of the trial) held exactly its num_workers workers;
- nothing left: no actor of this job alive and no placement group of it not removed, once
  ``Tuner.fit`` returned (stopped and exploited trials included).

Prints ``TUNE_REPORT <json>``: the example's summary and these checks. Used by
tests/e2e/test_cluster_tune.py.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # tune_lr imports gpt from beside it, as when run as a script
sys.path.insert(0, ROOT)

import ray  # noqa: E402
from ray.util.state import list_actors, list_placement_groups  # noqa: E402

import tune_lr  # noqa: E402


def _job_actors(job: str) -> list:
    return list_actors(filters=[("job_id", "=", job)], detail=True, limit=10_000, raise_on_missing_output=False)


def _leftovers(job: str, timeout_s: float = 60.0) -> dict:
    """This job's live actors and placement groups not removed, polled until none (kills are asynchronous)."""
    def look():
        actors = [f"{a.class_name} {a.actor_id}" for a in _job_actors(job) if a.state != "DEAD"]
        groups = [g.placement_group_id for g in list_placement_groups(detail=True, limit=10_000,
                                                                      raise_on_missing_output=False)
                  if g.creator_job_id == job and g.state != "REMOVED"]
        return {"actors": actors, "placement_groups": groups}

    deadline = time.monotonic() + timeout_s
    found = look()
    while (found["actors"] or found["placement_groups"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        found = look()
    return found


def main(argv: list) -> None:
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    job = ray.get_runtime_context().get_job_id()
    summary = tune_lr.main(argv)
    workers = [a for a in _job_actors(job) if a.class_name == "Worker"]
    per_group = Counter(a.placement_group_id for a in workers)
    trial_groups = {pg: t["num_workers"] for t in summary["trials"] for pg in t["placement_groups"]}
    checks = {
        "worker_actors": len(workers),
        "workers_outside_trial_groups": sorted(pg or "none" for pg in per_group if pg not in trial_groups),
        "trial_groups_with_wrong_worker_count": {pg: per_group.get(pg, 0) for pg, n in trial_groups.items()
                                                 if per_group.get(pg, 0) != n},
        "leftovers": _leftovers(job),
    }
    print("TUNE_REPORT " + json.dumps({**summary, "checks": checks}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
