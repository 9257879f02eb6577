"""The same parity through zr.Trainer with real Ray actors, every stage; state_dict loads strictly."""
import pytest
import torch

import zeroray as zr
from tests.dist.parity import loss_bound, param_bound, within
from tests.models import lm_loss, make_batches, parity_model, reference_run

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                                           weight_decay=0.1)
    return batches, reference_run(parity_model, lm_loss, make_opt, batches)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_parity(ray_local, reference, stage):
    batches, (ref_losses, ref_norms, ref_state) = reference
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                    zero=zr.ZeroConfig(stage=stage), scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        results = [trainer.step(b) for b in batches]
        for step, (res, want) in enumerate(zip(results, ref_losses)):
            within(f"step {step}: loss {res.loss!r} vs reference {want!r}, abs diff", abs(res.loss - want),
                   *loss_bound(want, None))
            assert res.grad_norm == pytest.approx(ref_norms[step], rel=1e-4)
            assert res.step == step + 1
        sd = trainer.state_dict()
        assert list(sd) == list(ref_state)
        for name, want in ref_state.items():
            within(f"{name}: max abs diff", (sd[name] - want).abs().max().item(), *param_bound(want, None))
        model = parity_model()
        model.load_state_dict(sd, strict=True)
        assert torch.equal(trainer.get_parameter("head.weight"), sd["emb.weight"])  # tied alias
        comm = trainer.comm_report()
        assert len(comm) == 2 and all(c["total_bytes"] > 0 for c in comm)
