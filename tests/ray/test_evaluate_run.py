"""Variable shapes, evaluation and inference through the Trainer (issue 24; [Note: inference calls]).

Hugging Face's GPT2LMHeadModel (tiny config, built in code) on 2 workers, trained on the dicts
of HF's own padding collator (tests/padded_data.py), whose padded length changes every step:

- ``step`` on two different lengths, then ``fit`` with ``eval_data``/``eval_every``: the losses
  and every evaluation equal single-process PyTorch with DDP's loss semantics (each worker's
  loss is HF's mean over its own tokens; the global loss, and each evaluation batch's, is the
  mean over the workers), so each evaluation saw exactly the weights of its step; the
  evaluations reach the StepResults, the metrics file and the log lines;
- ``evaluate`` on a ray.data.Dataset equals it on the same batches as a list;
- ``run(generate)`` with a different ``max_new_tokens`` per rank (``zeroray.worker_context()``)
  returns rank 0's tokens, equal to single-process greedy ``generate`` on the trained weights, at
  stages 3 and 1, and does not hang;
- ``run`` after training reads the trained parameters; an error in ``fn`` on one worker raises
  the worker's own error and the trainer goes on.
"""
import json
import logging

import pytest
import torch

import zeroray as zr
from tests.dist.test_variable_shapes import ADAMW, reference
from tests.padded_data import hf_loss, padded_batches
from tests.real_models import hf_gpt2
from zeroray.engine.batch import split_batch
from zeroray.runtime.fit import progress as progress_mod
from zeroray.runtime.controller.controller import TrainerState

WORLD = 2
LONGEST = (6, 11, 5, 9, 14, 7)
EVAL = padded_batches((8, 12), rows=4, seed=7)


@pytest.fixture(scope="module")
def trainers(ray_local):
    made = {}

    def get(stage):
        if stage not in made:
            made[stage] = zr.Trainer(hf_gpt2, hf_loss, optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(stage=stage),
                                     scaling=zr.ScalingConfig(num_workers=WORLD))
        return made[stage]

    yield get
    for trainer in made.values():
        trainer.shutdown()


def token_accuracy(model, batch):
    logits = model(**batch).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    counted = labels != -100
    return {"acc": ((logits.argmax(-1) == labels) & counted).sum() / counted.sum()}


def oracle_eval(state, batches):
    """Single-process evaluation with DDP's semantics: per batch the mean over the workers' shares."""
    model = hf_gpt2()
    model.load_state_dict(state)
    model.eval()
    totals = {"loss": 0.0, "acc": 0.0}
    with torch.no_grad():
        for batch in batches:
            for share in split_batch(batch, WORLD):
                totals["loss"] += hf_loss(model, share).item() / WORLD / len(batches)
                totals["acc"] += token_accuracy(model, share)["acc"].item() / WORLD / len(batches)
    return totals


def test_steps_on_changing_lengths_and_fit_with_evaluation(trainers, tmp_path, monkeypatch, caplog):
    trainer = trainers(3)
    batches = padded_batches(LONGEST, rows=2 * WORLD)
    states = {}
    ref_losses = reference(batches, states=states)[0]
    # Two steps whose batches are padded to different lengths (6, then 11 tokens).
    losses = [trainer.step(b).loss for b in batches[:2]]
    assert losses == pytest.approx(ref_losses[:2], rel=1e-5)

    monkeypatch.setattr(progress_mod, "_interactive", lambda: False)
    caplog.set_level(logging.INFO, logger="zeroray")
    trainer.metrics_path = str(tmp_path / "metrics.jsonl")
    results = trainer.fit(batches[2:], eval_data=EVAL, eval_every=2, eval_metric_fn=token_accuracy)
    assert [r.loss for r in results] == pytest.approx(ref_losses[2:], rel=1e-5)
    # Steps 3-6: evaluations after step 4 and step 6 (the end: not twice).
    assert [r.step for r in results if r.evaluation] == [4, 6]
    for r in results:
        if r.evaluation:
            want = oracle_eval(states[r.step], EVAL)
            assert r.evaluation == pytest.approx(want, rel=1e-5), r.step
    assert trainer.evaluate(EVAL, token_accuracy) == results[-1].evaluation  # the same weights, the same values
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [(r["step"], sorted(r)) for r in evals] == [(s, ["eval_acc", "eval_loss", "step", "time"]) for s in (4, 6)]
    assert evals[-1]["eval_loss"] == results[-1].evaluation["loss"]
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroray" and " eval " in r.getMessage()]
    assert [line.split(" eval ")[0] for line in lines] == ["zeroray step 4", "zeroray step 6"]
    assert all("loss" in line and "acc" in line for line in lines)
    assert trainer.step_count == 6 and trainer.state is TrainerState.IDLE


def test_evaluate_a_ray_dataset(trainers, ray_local):
    import ray.data

    trainer = trainers(3)
    fixed = padded_batches((10, 10), rows=4, seed=3)  # a Dataset's rows need one shape
    rows = [{k: v[i].numpy() for k, v in b.items()} for b in fixed for i in range(4)]
    dataset = ray.data.from_items(rows)
    want = trainer.evaluate(fixed, token_accuracy)
    assert trainer.evaluate(dataset, token_accuracy, batch_size=4) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="needs batch_size="):
        trainer.evaluate(dataset)
    with pytest.raises(ValueError, match="batch 0 has 1 rows, fewer than the 2 workers"):
        trainer.evaluate([{k: v[:1] for k, v in fixed[0].items()}])


def _generate(model, ids):
    rank = zr.worker_context().rank
    return model.generate(ids, max_new_tokens=4 + 5 * rank, do_sample=False, pad_token_id=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [3, 1])
def test_run_generate_stops_at_different_lengths_per_rank(trainers, stage):
    trainer = trainers(stage)
    if trainer.step_count == 0:
        trainer.step(padded_batches((9,), rows=4, seed=11)[0])
    ids = torch.tensor([[3, 17, 42], [8, 8, 1]])
    tokens = trainer.run(_generate, ids)
    model = hf_gpt2()
    model.load_state_dict(trainer.state_dict())
    model.eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # rank 0's length
    assert tokens.shape == (2, 3 + 4) and torch.equal(tokens, want)


def test_run_after_training_sees_the_trained_weights(trainers):
    trainer = trainers(3)
    trainer.step(padded_batches((7,), rows=4, seed=5)[0])
    params = trainer.run(lambda model: {name: p.detach() for name, p in model.named_parameters()})
    state = trainer.state_dict()
    assert set(params) <= set(state)
    for name, value in params.items():
        assert torch.equal(value, state[name]), name


def _fails_on_rank1(model, ids):
    if zr.worker_context().rank == 1:
        raise KeyError("no such prompt on rank 1")
    return model(ids).logits


def test_run_error_on_one_worker_raises_it(trainers):
    trainer = trainers(3)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(KeyError, match="no such prompt on rank 1") as info:
        trainer.run(_fails_on_rank1, ids)
    assert any("worker 1" in note for note in getattr(info.value, "__notes__", []))
    assert trainer.run(lambda model, x: model(x).logits.shape, ids) == (1, 3, 64)  # the group goes on
    with pytest.raises(ValueError, match="metric_fn's 'acc' is \\(2,\\), not a number"):
        trainer.evaluate(EVAL, lambda model, batch: {"acc": torch.ones(2)})
    assert trainer.evaluate(EVAL)["loss"] > 0
    with pytest.raises(RuntimeError, match="only known while a worker runs your code"):
        zr.worker_context()
