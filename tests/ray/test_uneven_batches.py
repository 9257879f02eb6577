"""Global batches that do not divide over the workers, through the Trainer ([Note: uneven splits]
in zeroray/engine/batch.py), against plain single-process PyTorch on the whole batches.

- ``step`` and ``fit`` on 7-row batches at 3 workers (3, 2, 2), resized in place to 2 (4, 3),
  give the losses and weights of one uninterrupted single-process run: the global batch, not the
  worker count, decides the step;
- ``evaluate`` weights each worker's value by its rows: single-process evaluation of the whole batch;
- a batch with fewer rows than workers x micro-batches is refused before anything is sent, and
  the trainer goes on;
- Ray Data: ``batch_size`` must divide by the workers (equal splits; refused clearly otherwise),
  but a worker's local batch may split unevenly over its micro-batches (3 rows over 2: 2, 1):
  the run equals single-process PyTorch on the global batches the workers read.
"""
import os

import pytest
import torch

import zeroray as zr
from tests.models import SEQ, VOCAB, lm_loss, make_batches, parity_model, reference_run

ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)


def _assert_state(got, want, atol=1e-5):
    for name, value in want.items():
        err = (got[name].to(value.dtype) - value).abs().max().item()
        assert err <= atol, f"{name}: max abs diff {err}"


def test_uneven_steps_fit_resize_and_evaluate_equal_whole_batch_pytorch(ray_local):
    batches = make_batches(6, batch=7, seed=5)
    ref_losses, ref_norms, ref_state = reference_run(parity_model, lm_loss, _adamw, batches)
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=3)) as trainer:
        results = [trainer.step(b) for b in batches[:2]]                        # 3 workers: 3, 2, 2 rows
        results += trainer.fit(batches, skip=2, num_steps=2, progress=False)
        trainer.resize(num_workers=2)                                            # 2 workers: 4, 3 rows
        results += trainer.fit(batches, progress=False)
        assert [r.step for r in results] == [1, 2, 3, 4, 5, 6]
        for step, (r, loss, norm) in enumerate(zip(results, ref_losses, ref_norms), start=1):
            assert r.loss == pytest.approx(loss, rel=1e-5), f"step {step}"
            assert r.grad_norm == pytest.approx(norm, rel=1e-5), f"step {step}"
        _assert_state(trainer.state_dict(), ref_state)

        # evaluate: 5 rows over 2 workers (3, 2), weighted by rows = the whole batch's mean loss
        eval_batches = make_batches(2, batch=5, seed=9)
        model = parity_model()
        model.load_state_dict(ref_state)
        model.eval()
        with torch.no_grad():
            want = sum(lm_loss(model, b).item() for b in eval_batches) / len(eval_batches)
        assert trainer.evaluate(eval_batches)["loss"] == pytest.approx(want, rel=1e-5)

        # a batch with fewer rows than workers x micro-batches: refused on the driver, nothing sent
        idx, tgt = batches[0]
        with pytest.raises(ValueError, match=r"the global batch has 1 rows, fewer than 2 worker\(s\) x 1 "
                                             r"micro-batch\(es\): every micro-batch of every worker needs at "
                                             r"least one row; use a global batch of at least 2 rows"):
            trainer.step((idx[:1], tgt[:1]))
        with pytest.raises(ValueError, match="evaluate: batch 0 has 1 rows, fewer than the 2 workers"):
            trainer.evaluate([(idx[:1], tgt[:1])])
        assert trainer.step(batches[0]).step == 7  # nothing was lost


def _rank_logging_loss(log_dir):
    def loss(model, batch):
        # one line per micro-batch, in order, in a file named after the worker's rank
        with open(os.path.join(log_dir, f"rank{zr.worker_context().rank}.ids"), "a") as f:
            f.write(" ".join(str(i) for i in batch["id"].tolist()) + "\n")
        return lm_loss(model, (batch["idx"], batch["tgt"]))
    return loss


def test_ray_data_equal_splits_with_uneven_micro_batches(ray_local, tmp_path):
    import ray.data

    rows, global_batch, workers, accum = 36, 6, 2, 2   # local batches of 3 rows, micro-batches of 2 and 1
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    dataset = ray.data.from_items([{"id": i, "idx": idx[i].numpy(), "tgt": tgt[i].numpy()} for i in range(rows)],
                                  override_num_blocks=3)
    with zr.Trainer(parity_model, _rank_logging_loss(str(tmp_path)), optimizer=zr.AdamW(**ADAMW),
                    zero=zr.ZeroConfig(stage=2, grad_accum_steps=accum),
                    scaling=zr.ScalingConfig(num_workers=workers)) as trainer:
        with pytest.raises(ValueError, match=r"batch_size=7 does not split evenly over 2 worker\(s\).*divisible "
                                             r"by 2 \(the workers\): use 6 or 8; or pass fit an iterable of global "
                                             r"batches, which zeroray splits unevenly \(7 rows over 2 workers: 4, 3\)"):
            trainer.fit(dataset, batch_size=7)
        results = trainer.fit(dataset, batch_size=global_batch, progress=False)
        state = trainer.state_dict()
    steps = len(results)
    assert steps == rows // global_batch
    per_rank = []
    for rank in range(workers):
        lines = [[int(i) for i in line.split()] for line in (tmp_path / f"rank{rank}.ids").read_text().splitlines()]
        assert [len(line) for line in lines] == [2, 1] * steps  # each local batch of 3 over 2 micro-batches
        per_rank.append([lines[2 * s] + lines[2 * s + 1] for s in range(steps)])
    global_ids = [torch.tensor(sum((r[s] for r in per_rank), [])) for s in range(steps)]
    ref_losses, _, ref_state = reference_run(parity_model, lm_loss, _adamw, [(idx[i], tgt[i]) for i in global_ids])
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
    _assert_state(state, ref_state)
