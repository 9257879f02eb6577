"""Run examples/tune_lr.py's sweep with the given arguments as a driver of the Ray cluster that
RAY_ADDRESS names, then check the cluster from here, while this driver's job still exists (Ray's
state API; the cluster runs the dashboard it needs):

- placement: every zeroray worker actor of the run ran in a trial's placement group, and each
  trial's placement group (one per start of the trial) held exactly its workers. A trial's
  placement group is read from Ray's state, not from the trial's results: the group that holds
  the trial's own (Tune trainable) actor, whose bundles after the first are the workers'. The
  results are no record of every start: when Tune restarts a trial from a checkpoint (PBT's
  pause and exploit), its JSON logger first copies the trial's result.json back from the
  storage path, and rows written to the staging copy since the last sync are lost;
- the placement groups the trials reported (a ``placement_group`` in each result) are among
  those, each with the trial's reported num_workers workers;
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


def _trial_groups(groups: set) -> dict:
    """Per trial placement group (one holding a trial's own actor): its worker bundles, every bundle
    after the trial actor's first one."""
    found = {g.placement_group_id: g for g in list_placement_groups(detail=True, limit=10_000,
                                                                    raise_on_missing_output=False)}
    return {pg: len(found[pg].bundles) - 1 for pg in groups if pg in found}


def main(argv: list) -> None:
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    job = ray.get_runtime_context().get_job_id()
    summary = tune_lr.main(argv)
    actors = _job_actors(job)
    workers = [a for a in actors if a.class_name == "Worker"]
    per_group = Counter(a.placement_group_id for a in workers)
    trial_groups = _trial_groups({a.placement_group_id for a in actors
                                  if a.class_name != "Worker" and a.placement_group_id})
    reported = {pg: t["num_workers"] for t in summary["trials"] for pg in t["placement_groups"]}
    checks = {
        "worker_actors": len(workers),
        "trial_groups": len(trial_groups),
        "workers_outside_trial_groups": sorted(pg or "none" for pg in per_group if pg not in trial_groups),
        "trial_groups_with_wrong_worker_count": {pg: per_group.get(pg, 0) for pg, n in trial_groups.items()
                                                 if per_group.get(pg, 0) != n},
        "reported_groups_not_trial_groups": sorted(pg for pg in reported if pg not in trial_groups),
        "reported_groups_with_wrong_worker_count": {pg: per_group.get(pg, 0) for pg, n in reported.items()
                                                    if per_group.get(pg, 0) != n},
        "leftovers": _leftovers(job),
    }
    print("TUNE_REPORT " + json.dumps({**summary, "checks": checks}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
