"""An optimizer given to ``Trainer.restore`` replaces the checkpoint's learning rate ([Note: an
optimizer given to restore] in zeroray/runtime/restore.py): the restored run trains as PyTorch
does when the rate is changed at that step, and the log says what changed. This is what makes a
Ray Tune PBT exploit (zeroray.tune) train at its mutated lr. Without an optimizer, the run goes
on at the checkpoint's rate."""
import logging

import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run

STEPS, SAVE_AT = 6, 3
LR, NEW_LR = 1e-2, 3e-3


def _reference(new_lr):
    """PyTorch, with the lr changed to ``new_lr`` after step SAVE_AT."""
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
    switch = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 if e < SAVE_AT else new_lr / LR)
    return reference_run(parity_model, lm_loss, make_opt, make_batches(STEPS), scheduler=switch)


def _saved(tmp_path):
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=LR), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.fit(make_batches(STEPS), num_steps=SAVE_AT, progress=False)
        return trainer.save(str(tmp_path))


def test_the_given_optimizers_lr_trains_after_restore(ray_local, tmp_path, caplog):
    path = _saved(tmp_path)
    ref_losses, _, ref_state = _reference(NEW_LR)
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        trainer = zr.Trainer.restore(path, parity_model, lm_loss, optimizer=zr.AdamW(lr=NEW_LR),
                                     zero=zr.ZeroConfig(stage=1), scaling=zr.ScalingConfig(num_workers=3))
    with trainer:
        losses = [r.loss for r in trainer.fit(make_batches(STEPS), progress=False)]
        sd = trainer.state_dict()
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    assert max((sd[k] - v).abs().max().item() for k, v in ref_state.items()) <= 1e-5
    assert "the optimizer given to restore replaces the checkpoint's learning rate(s): lr 0.01 -> 0.003" in caplog.text
    unchanged, _, _ = _reference(LR)
    assert abs(losses[-1] - unchanged[-1]) > 1e-4  # the rate mattered: the checkpoint's would train otherwise


def test_without_an_optimizer_the_checkpoints_lr_goes_on(ray_local, tmp_path, caplog):
    path = _saved(tmp_path)
    ref_losses, _, _ = _reference(LR)
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        trainer = zr.Trainer.restore(path, parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2),
                                     zero=zr.ZeroConfig(stage=3), fallback=True)
    with trainer:
        losses = [r.loss for r in trainer.fit(make_batches(STEPS), progress=False)]
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    assert "replaces the checkpoint's learning rate" not in caplog.text
