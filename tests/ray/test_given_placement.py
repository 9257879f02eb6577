"""``ScalingConfig(placement_group=pg, placement_bundles=...)``: the workers go into bundles of a
placement group made elsewhere (a Ray Tune trial's, zeroray/tune/), and nowhere else ([Note: given
placement group] in zeroray/runtime/worker_group/placement.py).

Which bundle an actor holds is read from Ray's own accounting: a bundle's resource
``CPU_group_<i>_<pg id>`` is free until an actor takes it.
"""
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run
from tests.ray.test_faults import KillingData, _kill_actor
from tests.ray.test_shutdown import assert_released, live_placement_groups

STEPS = 6


@pytest.fixture
def pg(ray_local):
    group = placement_group([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(group.ready(), timeout=60)
    yield group
    remove_placement_group(group)


def _taken(pg):
    """The bundles of ``pg`` an actor holds now."""
    free = ray.available_resources()
    return sorted(i for i in range(pg.bundle_count) if free.get(f"CPU_group_{i}_{pg.id.hex()}", 0.0) < 1.0)


def _wait_taken(pg, want, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while _taken(pg) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return _taken(pg)


def _trainer(pg, bundles=(2, 0), **kwargs):
    return zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=3),
                      scaling=zr.ScalingConfig(num_workers=len(bundles), placement_group=pg, placement_bundles=bundles),
                      **kwargs)


def test_workers_take_the_given_bundles_and_train_as_usual(pg):
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_losses, _, ref_state = reference_run(parity_model, lm_loss, make_opt, batches)
    with _trainer(pg) as trainer:
        assert {w["placement_group_id"] for w in trainer.workers} == {pg.id.hex()}
        assert _wait_taken(pg, [0, 2]) == [0, 2]  # rank 0 in bundle 2, rank 1 in bundle 0; bundle 1 left free
        losses = [r.loss for r in trainer.fit(batches, progress=False)]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        sd = trainer.state_dict()
        assert max((sd[k] - v).abs().max().item() for k, v in ref_state.items()) <= 1e-5
        assert trainer.controller.group.pg is None  # not the group's own
        with pytest.raises(ValueError, match=r"resize\(3\).*given placement group.*save\(\) and Trainer.restore"):
            trainer.resize(3)
        assert trainer.num_workers == 2 and trainer.step(batches[0]).step == STEPS + 1  # the refusal changed nothing
    assert _wait_taken(pg, []) == []  # shut down: the bundles are free again...
    assert pg.id.hex() in live_placement_groups()  # ...and the placement group is its owner's, still there


def test_what_cannot_go_in_given_bundles_is_refused(pg):
    with pytest.raises(ValueError, match=r"spares=.*placement groups of zeroray.s own.*use spares=0"):
        _trainer(pg, failure=zr.FailureConfig(snapshot_every=1, spares=1))
    with pytest.raises(ValueError, match=r"bundle 1 of the given placement group is \{'CPU': 1.0\}.*needs \{'CPU': 2"):
        zr.Trainer(parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2, cpus_per_worker=2, placement_group=pg,
                                                                    placement_bundles=(1, 2)))
    with pytest.raises(ValueError, match=r"bundle 5 of the given placement group is None"):
        _trainer(pg, bundles=(0, 5))
    assert _wait_taken(pg, []) == []  # nothing was started, or it was released


def test_a_restart_after_a_worker_death_stays_in_the_given_bundles(pg, tmp_path):
    """The restart's group size comes from the given bundles (free again once the old group is
    gone), not from the cluster's free CPUs, which a placement group's bundles are not part of."""
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    _, _, ref_state = reference_run(parity_model, lm_loss, make_opt, batches)
    with _trainer(pg, bundles=(1, 2), failure=zr.FailureConfig(max_failures=1),
                  checkpoint=zr.CheckpointConfig(path=str(tmp_path), every_steps=2)) as trainer:
        old = list(trainer.controller.group.actors)
        data = KillingData(batches, 3, lambda: _kill_actor(trainer.controller.group.actors[1]))
        trainer.fit(data, progress=False)
        assert len(trainer.recoveries) == 1 and trainer.num_workers == 2
        assert {w["placement_group_id"] for w in trainer.workers} == {pg.id.hex()}
        assert _wait_taken(pg, [1, 2]) == [1, 2]
        assert_released([a._actor_id.hex() for a in old], [])
        sd = trainer.state_dict()
        assert max((sd[k] - v).abs().max().item() for k, v in ref_state.items()) <= 1e-5
