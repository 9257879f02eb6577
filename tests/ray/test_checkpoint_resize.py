"""Issue 6 through the Trainer: save at 2 workers, restore at 1, 3, 4 workers and other stages,
resize in place 2 -> 3 -> 1; each run equals uninterrupted single-process training within 1e-5."""
import os

import pytest
import torch

import zeroray as zr
from zeroray.checkpoint import CheckpointError, latest_checkpoint
from tests.models import lm_loss, make_batches, parity_model, reference_run

STEPS, SPLIT = 8, 4
OPT = dict(lr=1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def reference():
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)
    return batches, reference_run(parity_model, lm_loss, make_opt, batches)


def check(trainer, results, ref, first_step):
    ref_losses, _, ref_state = ref
    for i, res in enumerate(results):
        assert res.loss == pytest.approx(ref_losses[first_step + i], rel=1e-5), f"step {first_step + i}"
    sd = trainer.state_dict()
    worst = max((sd[k] - v).abs().max().item() for k, v in ref_state.items())
    assert worst <= 1e-5, worst
    return worst


def test_save_then_restore_at_other_sizes_and_stages(ray_local, reference, tmp_path):
    batches, ref = reference
    root = str(tmp_path / "ckpt")
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        for b in batches[:SPLIT]:
            trainer.step(b)
        path = trainer.save(root)
    assert latest_checkpoint(root) == path and os.path.basename(path) == f"step_{SPLIT:08d}"
    for workers, stage in ((3, 1), (4, 2), (1, 0)):
        with zr.Trainer.restore(root, parity_model, lm_loss, optimizer=zr.AdamW(**OPT),
                                zero=zr.ZeroConfig(stage=stage),
                                scaling=zr.ScalingConfig(num_workers=workers)) as restored:
            assert restored.step_count == SPLIT
            results = [restored.step(b) for b in batches[SPLIT:]]
            worst = check(restored, results, ref, SPLIT)
            print(f"restore 2 workers/stage 3 -> {workers} workers/stage {stage}: max param diff {worst:.2e}")


def test_resize_in_place(ray_local, reference):
    batches, ref = reference
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        results = [trainer.step(b) for b in batches[:3]]
        trainer.resize(3)
        assert trainer.num_workers == 3
        results += [trainer.step(b) for b in batches[3:6]]
        trainer.resize(1)
        assert trainer.num_workers == 1
        results += [trainer.step(b) for b in batches[6:]]
        worst = check(trainer, results, ref, 0)
        print(f"resize 2 -> 3 -> 1 in place: max param diff {worst:.2e}")


def test_restore_from_a_directory_that_is_not_a_checkpoint(ray_local, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint"):
        zr.Trainer.restore(str(tmp_path), parity_model, lm_loss)
