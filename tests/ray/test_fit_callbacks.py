"""``Trainer.fit(callbacks=[...])`` (zeroray/runtime/fit/callbacks.py): every step's result reaches
``on_step`` in order, after its checkpoint and evaluation; a step a callback ``pauses_after`` is
the last one the workers ran when ``on_step`` sees it, so a save there holds exactly that step
(what zeroray.tune's reports rely on); an error in a callback ends fit and is not retried."""
import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run
from zeroray.checkpoint import full_state_dict, load_manifest

STEPS = 6


class Recorder(zr.Callback):
    def __init__(self, trainer, save_at, root):
        self.trainer, self.save_at, self.root = trainer, save_at, root
        self.seen, self.saved = [], {}

    def pauses_after(self, step):
        return step in self.save_at

    def on_step(self, result):
        self.seen.append((result.step, result.evaluation is not None, self.trainer.step_count))
        if result.step in self.save_at:
            self.saved[result.step] = self.trainer.save(self.root)


def test_on_step_sees_every_step_and_a_pause_saves_exactly_its_step(ray_local, tmp_path):
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1), zero=zr.ZeroConfig(stage=2),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        recorder = Recorder(trainer, save_at={3, 5}, root=str(tmp_path))
        results = trainer.fit(batches, progress=False, eval_data=batches[:2], eval_every=2, callbacks=[recorder])
    assert [s for s, _, _ in recorder.seen] == [r.step for r in results] == list(range(1, STEPS + 1))
    assert [e for _, e, _ in recorder.seen] == [False, True, False, True, False, True]  # its evaluation came first
    for step, path in recorder.saved.items():
        assert load_manifest(path).step == step
        want = reference_run(parity_model, lm_loss, make_opt, batches[:step])[2]
        got = full_state_dict(path)
        assert max((got[k] - v).abs().max().item() for k, v in want.items()) <= 1e-5, step


class Failing(zr.Callback):
    def on_step(self, result):
        if result.step == 2:
            raise KeyError("from the callback")


def test_a_callback_error_ends_fit(ray_local):
    batches = make_batches(4)
    with zr.Trainer(parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2),
                    failure=zr.FailureConfig(max_failures=2)) as trainer:
        with pytest.raises(KeyError, match="from the callback"):
            trainer.fit(batches, progress=False, callbacks=[Failing()])
        assert trainer.recoveries == [] and trainer.step_count in (2, 3)  # the step in flight was collected
        assert trainer.data_position == trainer.step_count
        more = trainer.fit(batches, progress=False)  # usable: it goes on where the data stopped
        assert more[-1].step == 4
        with pytest.raises(ValueError, match="callbacks must be zr.Callback objects"):
            trainer.fit(batches, callbacks=[lambda r: None])
