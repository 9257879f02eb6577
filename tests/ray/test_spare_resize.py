"""Spares never stand in the way of a resize ([Note: spare placement] in
zeroray/runtime/worker_group/placement.py): a trainer with two spares resizes 2 -> 3 -> 2 workers on a
cluster that could not hold its old workers, its spares and the new workers at once, comes back
with its two spares after each resize, and trains as single-process PyTorch does (the resize
tests' tolerance; the same run without spares is test_checkpoint_resize's).

At 1.5 CPUs a worker on the fixture's 8 CPUs: 2 workers and 2 spares hold 6, so with the spares
kept the resize to 3 (4.5 more) could not be placed; with them released it holds 3 + 4.5.
"""
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run
from tests.ray.test_checkpoint_resize import OPT, check

CYCLE = 1  # steps between resizes


def test_resize_with_two_spares_releases_and_restarts_them(ray_local):
    spares = 2
    batches = make_batches(3 * CYCLE)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)
    ref = reference_run(parity_model, lm_loss, make_opt, batches)
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT),
                    zero=zr.ZeroConfig(stage=3, collective_timeout_s=10.0),
                    scaling=zr.ScalingConfig(num_workers=2, cpus_per_worker=1.5, placement_timeout_s=20.0),
                    failure=zr.FailureConfig(max_failures=1, snapshot_every=1, spares=spares)) as trainer:
        results = trainer.fit(batches, num_steps=CYCLE, progress=False)
        for workers in (3, 2):
            trainer.resize(workers)
            assert trainer.num_workers == workers
            assert len(trainer.controller.group.spares) == spares
            # fit goes on from the data position: the next CYCLE batches
            results += trainer.fit(batches, num_steps=CYCLE, progress=False)
        assert trainer.controller.group.spares_warm(120), "the spares were not placed and started after the resize"
        assert len(results) == 3 * CYCLE
        check(trainer, results, ref, 0)
