"""The Controller is the only writer of ``data_position`` ([Note: trainer states] in
zeroray/runtime/controller/controller.py): fit's collected steps move it on, ``trainer.data_position = p``
goes through ``Controller.seek`` (idle only, an int >= 0), and the next fit starts there."""
import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run

OPT = dict(lr=1e-2, weight_decay=0.1)


def test_fit_counts_batches_and_seek_moves_the_next_fit(ray_local):
    batches = make_batches(5)
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=2),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(batches[0])  # a step outside fit trains on no batch of fit's data
        assert (trainer.step_count, trainer.data_position) == (1, 0)
        trainer.data_position = 3
        results = trainer.fit(batches, num_steps=2, progress=False)  # batches 3 and 4
        assert (trainer.step_count, trainer.data_position) == (3, 5)
        make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)  # noqa: E731
        want = reference_run(parity_model, lm_loss, make_opt, [batches[0], batches[3], batches[4]])[0]
        assert [r.loss for r in results] == pytest.approx(want[1:], rel=1e-5)
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match=f"data_position={bad!r} must be an integer >= 0"):
                trainer.data_position = bad
        assert trainer.data_position == 5
