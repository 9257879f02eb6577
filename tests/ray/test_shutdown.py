"""Clean shutdown: shutdown(), garbage collection, and an exception (Ctrl-C) inside ``with``
all release the worker actors and the placement group.

Leaks are read from Ray's GCS tables (actors, placement groups) of this job. The state API
(ray.util.state.list_actors) needs the dashboard, which the test cluster does not start.
"""
import gc
import time

import pytest
import ray

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model


def live_actors():
    """Ids of this job's actors that are not dead."""
    job = ray.get_runtime_context().get_job_id()
    return {aid for aid, a in ray._private.state.actors().items() if a["JobID"] == job and a["State"] != "DEAD"}


def live_placement_groups():
    return {pid for pid, p in ray.util.placement_group_table().items() if p["state"] != "REMOVED"}


def group_ids(trainer):
    group = trainer.controller.group
    return {a._actor_id.hex() for a in group.actors}, {group.pg.id.hex()}


def assert_released(actor_ids, pg_ids, timeout_s=30.0):
    """The given actors are dead and the placement groups removed (ray.kill is asynchronous: poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_actors, left_pgs = live_actors() & set(actor_ids), live_placement_groups() & set(pg_ids)
        if not left_actors and not left_pgs:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: actors {left_actors}, placement groups {left_pgs}")
        time.sleep(0.2)


def _trainer(num_workers=1, **kwargs):
    return zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=1e-2), zero=zr.ZeroConfig(stage=3),
                      scaling=zr.ScalingConfig(num_workers=num_workers), **kwargs)


def test_shutdown_releases_actors_and_placement_group(ray_local):
    trainer = _trainer()
    actors, pgs = group_ids(trainer)
    assert actors <= live_actors() and pgs <= live_placement_groups()
    trainer.step(make_batches(1)[0])
    trainer.shutdown()
    trainer.shutdown()  # twice is fine
    assert_released(actors, pgs)
    with pytest.raises(RuntimeError, match="shut down"):
        trainer.step(make_batches(1)[0])


def test_garbage_collection_releases(ray_local):
    trainer = _trainer()
    actors, pgs = group_ids(trainer)
    del trainer
    gc.collect()
    assert_released(actors, pgs)


class _CtrlC:
    """Re-iterable data whose iterator raises KeyboardInterrupt at batch ``at`` (a Ctrl-C inside fit)."""

    def __init__(self, batches, at):
        self.batches, self.at = batches, at

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.at:
                raise KeyboardInterrupt
            yield batch


def test_ctrl_c_inside_with_releases(ray_local):
    """An exception in the driver (here Ctrl-C, raised inside fit) leaves `with` and releases everything."""
    ids = {}
    with pytest.raises(KeyboardInterrupt):
        with _trainer() as trainer:
            ids["actors"], ids["pgs"] = group_ids(trainer)
            trainer.fit(_CtrlC(make_batches(4), at=2), progress=False)
    assert trainer.step_count == 2
    assert_released(ids["actors"], ids["pgs"])
