"""``ZeroConfig(stage="auto")`` on a real local Ray: the Trainer resolves it before any worker starts,
logs the table and the reason, and trains at the chosen stage."""
import logging

import pytest

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model


def test_auto_is_a_valid_stage_and_other_strings_are_not():
    assert zr.ZeroConfig(stage="auto").stage == "auto"
    with pytest.raises(ValueError, match="'auto'"):
        zr.ZeroConfig(stage="fast")


def test_trainer_resolves_auto_on_the_cluster_found(ray_local, caplog):
    caplog.set_level(logging.INFO, logger="zeroray")
    trainer = zr.Trainer(parity_model, lm_loss, zero=zr.ZeroConfig(stage="auto"),
                         scaling=zr.ScalingConfig(num_workers=2))
    try:
        assert trainer.zero.stage in (0, 1, 2, 3)
        line = next(r.getMessage() for r in caplog.records if "stage='auto'" in r.getMessage())
        assert f"stage {trainer.zero.stage} is the cheapest stage that fits" in line
        print(line)
        trainer.step(make_batches(1)[0])
    finally:
        trainer.shutdown()
