"""The worker's resident memory, broken down (issue 17): memory_report()['rss'] through the real
Ray worker, whose engine runs on one compute thread (zeroray/memory/process.py)."""
import pytest

import zeroray as zr
from tests.models import VOCAB, lm_loss, make_batches, parity_model


def raising_loss(model, batch):
    idx, _ = batch
    if bool((idx == VOCAB - 1).all()):
        raise ValueError("this batch is all padding")
    return lm_loss(model, batch)


@pytest.mark.parametrize("stage", [1, 3])
def test_rss_breakdown_through_the_worker(ray_local, stage):
    trainer = zr.Trainer(parity_model, raising_loss, optimizer=zr.AdamW(lr=1e-2),
                         zero=zr.ZeroConfig(stage=stage), scaling=zr.ScalingConfig(num_workers=2), seed=0)
    try:
        batches = make_batches(3)
        for batch in batches[:2]:
            trainer.step(batch)
        for rep in trainer.memory_report():
            rss = rep["rss"]
            assert rep["measured"]["total"] == pytest.approx(rep["estimate"]["total"], rel=0.02)
            assert rss["model_states"] == rep["measured"]["total"]
            assert rss["baseline"] > 100e6  # Python, torch and Ray
            # The step peak holds the baseline and the model states; the lifetime peak holds both phases.
            assert rss["step_peak"] >= rss["baseline"] + rss["model_states"]
            assert rep["peak_rss_bytes"] == rss["peak_rss"] >= max(rss["step_peak"], rss["construction_peak"]) - 2**16
            assert rss["other"] == rss["step_peak"] - rss["baseline"] - sum(
                rss[k] for k in ("model_states", "gathered_window", "buckets", "activations"))
        # A step that raises on the compute thread reaches the driver with its message, and the
        # trainer stays usable.
        idx, tgt = batches[2]
        with pytest.raises(Exception, match="all padding"):
            trainer.step((idx.fill_(VOCAB - 1), tgt))
        trainer.step(make_batches(1)[0])
    finally:
        trainer.shutdown()
