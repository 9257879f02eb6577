"""An optimizer that is not element-wise through the Trainer, on real Ray actors (issue 41): a
checkpoint saved at 2 workers, stage 3, restored at 3 workers, stage 1, and resized in place to
2; every run equals one uninterrupted single-process torch run within the parity tolerance.
Restore without the optimizer continues the saved one where it is data (Adafactor with param
groups and an LR scheduler, saved at stage 2 and restored at another size and stage), and asks
for it where it is code (the Muon recipe's class), before any worker starts.
Then a worker SIGKILLed mid-fit with in-memory snapshots: the recovery carries each parameter's
state to its owner, and the run equals the uninterrupted one bitwise. The memory report shows
the owner map's share and imbalance."""
import functools

import pytest
import torch

import zeroray as zr
from zeroray.engine.optim_rebuild import RebuildError
from tests.models import lm_loss, make_batches, parity_model, reference_run
from tests.ray.test_checkpoint_resize import check as check_against
from tests.ray.test_restore_optimizer import reference
from tests.ray.test_faults import KillingData, gated_loss
from tests.ray.test_snapshot_recovery import _arm_kill
from tests.whole_param_optimizers import muon_adamw, trainable

STEPS, SPLIT = 8, 3


def test_restore_and_resize_carry_each_parameters_state(ray_local, tmp_path):
    batches = make_batches(STEPS)
    ref_losses, _, ref_state = reference_run(parity_model, lm_loss, lambda m: muon_adamw(trainable(m)), batches)

    def check(trainer, results, first):
        for i, res in enumerate(results):
            assert res.loss == pytest.approx(ref_losses[first + i], rel=1e-5), f"step {first + i}"
        if first + len(results) < STEPS:
            return None  # the reference's parameters are those after every step
        sd = trainer.state_dict()
        worst = max((sd[k] - v).abs().max().item() for k, v in ref_state.items())
        assert worst <= 1e-5, worst
        return worst

    root = str(tmp_path / "ckpt")
    with zr.Trainer(parity_model, lm_loss, optimizer=muon_adamw, zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        check(trainer, [trainer.step(b) for b in batches[:SPLIT]], 0)
        trainer.save(root)
        report = trainer.memory_report()
    shares = [r["whole_params"] for r in report]
    assert sum(s["held_params"] for s in shares) == len(trainable(parity_model()))
    assert all(0 < s["held_numel"] < sum(x["held_numel"] for x in shares) for s in shares), shares
    assert all(s["state_bytes"] > 0 and s["owner_imbalance"] >= 1.0 for s in shares), shares
    assert all(s["exchange_buffers"] == 0 < s["exchange_step_bytes"] for s in shares), shares  # the step's only
    with pytest.raises(RebuildError, match=r"MuonAdamW.*optimizer=lambda params"):  # code: restate it
        zr.Trainer.restore(root, parity_model, lm_loss, zero=zr.ZeroConfig(stage=1), scaling=zr.ScalingConfig(num_workers=3))
    with zr.Trainer.restore(root, parity_model, lm_loss, optimizer=muon_adamw, zero=zr.ZeroConfig(stage=1),
                            scaling=zr.ScalingConfig(num_workers=3)) as restored:
        assert restored.step_count == SPLIT
        results = [restored.step(b) for b in batches[SPLIT:SPLIT + 2]]
        restored.resize(2)
        results += [restored.step(b) for b in batches[SPLIT + 2:]]
        worst = check(restored, results, SPLIT)
        print(f"2 workers/stage 3 -> restored at 3 workers/stage 1 -> resized to 2: max param diff {worst:.1e}")


def test_restore_without_the_optimizer_continues_adafactor(ray_local, tmp_path):
    """Adafactor with no weight decay on the 1-D parameters and a StepLR, saved at stage 2 by 2
    workers, restored with nothing restated at stage 3 by 3: torch's class, the groups'
    overrides and the scheduler's position come from the checkpoint's record, the factored state
    from its owners' files, and the run equals uninterrupted single-process torch."""
    batches = make_batches(STEPS)
    recipe = dict(optimizer=lambda p: torch.optim.Adafactor(p, lr=1e-2, weight_decay=0.1),
                  param_groups=lambda name, p: {"weight_decay": 0.0} if p.ndim < 2 else {},
                  scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    ref = reference(recipe["optimizer"], batches, scheduler=recipe["scheduler"], param_groups=recipe["param_groups"])
    root = str(tmp_path / "ckpt")
    with zr.Trainer(parity_model, lm_loss, zero=zr.ZeroConfig(stage=2), scaling=zr.ScalingConfig(num_workers=2),
                    **recipe) as trainer:
        for b in batches[:SPLIT]:
            trainer.step(b)
        trainer.save(root)
    with zr.Trainer.restore(root, parity_model, lm_loss, zero=zr.ZeroConfig(stage=3),
                            scaling=zr.ScalingConfig(num_workers=3)) as restored:
        results = [restored.step(b) for b in batches[SPLIT:]]
        worst = check_against(restored, results, ref, SPLIT)
        print(f"Adafactor, groups, StepLR: 2 workers/stage 2 -> restored unstated at 3 workers/stage 3: "
              f"max param diff {worst:.1e}")


def _trainer(gate, ckpt):
    return zr.Trainer(parity_model, functools.partial(gated_loss, str(gate)), optimizer=muon_adamw,
                      zero=zr.ZeroConfig(stage=2, collective_timeout_s=10.0), scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=1, snapshot_every=1),
                      checkpoint=zr.CheckpointConfig(path=str(ckpt)))


def test_recovery_from_an_in_memory_snapshot_is_bitwise(ray_local, tmp_path):
    batches = make_batches(STEPS)
    gate = tmp_path / "gate"
    gate.mkdir()
    with _trainer(gate, tmp_path / "ref") as trainer:
        ref = trainer.fit(batches, progress=False)
        ref_state = trainer.state_dict()
    with _trainer(gate, tmp_path / "ckpt") as trainer:
        trainer.save()  # step 0: the disk checkpoint is far behind the snapshot
        arm, landed, target = _arm_kill(trainer, gate, batches[5])
        results = trainer.fit(KillingData(batches, 5, arm), progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        assert rec["restored_from"] == "memory" and rec["step"] == 5 and rec["redone_steps"] <= 1, rec
        state = trainer.state_dict()
    assert [r.loss for r in results] == [r.loss for r in ref]  # bitwise
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
