"""Bad input: every mistake gets an error that says what was wrong and what to do.

Configuration values are covered field by field in tests/unit/test_config.py; here the
mistakes that need the Trainer (and its workers) to show up. Each test adds its rows to
``TABLE``; run with ``-s`` to print the table of inputs and messages at the end.
"""
import pytest
import torch
import torch.nn as nn

import zeroray as zr
from tests.models import VOCAB, lm_loss, make_batches, parity_model
from tests.ray.test_shutdown import assert_released, live_actors, live_placement_groups
from zeroray.errors import StepError
from zeroray.runtime.failures import WorkerSetupError

TABLE = []
# A worker whose share of the batch is made only of one of these tokens makes picky_loss misbehave.
NAN_MARK, VECTOR_MARK, RAISE_MARK = VOCAB - 1, VOCAB - 2, VOCAB - 3


def _record(what, error):
    # A worker's error arrives as itself, its traceback as the cause; the table shows the error.
    notes = " ".join(getattr(error, "__notes__", []))
    TABLE.append((what, type(error).__name__, str(error).strip().splitlines()[0] + (f" + note: {notes}" if notes else "")))


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    print("\n\n| bad input | error | message |\n| --- | --- | --- |")
    for what, kind, message in TABLE:
        print(f"| {what} | {kind} | {message} |")


def picky_loss(model, batch):
    idx, _ = batch
    loss = lm_loss(model, batch)
    if bool((idx == NAN_MARK).all()):
        return loss * float("nan")
    if bool((idx == VECTOR_MARK).all()):
        return loss.expand(idx.shape[0])  # one loss per row: not reduced to a scalar
    if bool((idx == RAISE_MARK).all()):
        raise KeyError("labels")  # a bug in user code, on this worker only
    return loss


def broken_model():
    raise RuntimeError("cannot build the model: vocab file 'vocab.json' not found")


def frozen_model():
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    return model


def _marked(mark, seed=5, rows=slice(None)):
    idx, tgt = make_batches(1, seed=seed)[0]
    idx = idx.clone()
    idx[rows] = mark
    return idx, tgt


def test_invalid_optimizer_spec():
    """Checked on the driver before any worker starts (no Ray needed)."""
    for what, spec, match in [("optimizer='adam'", "adam", "pass zr.AdamW"),
                              ("optimizer=torch.optim.Adam (the class)", torch.optim.Adam, "is a class"),
                              ("zr.AdamW(lr=-1)", None, "AdamW.lr=-1")]:
        with pytest.raises(ValueError, match=match) as info:
            zr.Trainer(parity_model, lm_loss, optimizer=spec if spec is not None else zr.AdamW(lr=-1))
        _record(what, info.value)
    with pytest.raises(ValueError, match="loss_fn must be a callable") as info:
        zr.Trainer(parity_model, "cross_entropy")
    _record("loss_fn='cross_entropy'", info.value)


def test_config_mistakes_caught_before_any_worker_starts():
    """The config dataclasses validate on construction (every field: tests/unit/test_config.py)."""
    for what, build, match in [
            ("ZeroConfig(stage=4)", lambda: zr.ZeroConfig(stage=4), r"ZeroConfig\.stage=4"),
            ("ScalingConfig(num_workers=0)", lambda: zr.ScalingConfig(num_workers=0), r"ScalingConfig\.num_workers=0"),
            ("ZeroConfig(bucket_bytes=0)", lambda: zr.ZeroConfig(bucket_bytes=0), r"ZeroConfig\.bucket_bytes=0"),
            ("ZeroConfig(prefetch_bytes=-1)", lambda: zr.ZeroConfig(prefetch_bytes=-1),
             r"ZeroConfig\.prefetch_bytes=-1"),
            ("zero={'stage': 3} (a dict)", lambda: zr.Trainer(parity_model, lm_loss, zero={"stage": 3}),
             r"zero must be a zr\.ZeroConfig")]:
        with pytest.raises(ValueError, match=match) as info:
            build()
        _record(what, info.value)


def test_model_fn_raising_shows_worker_traceback(ray_local):
    actors, pgs = live_actors(), live_placement_groups()
    with pytest.raises(WorkerSetupError) as info:
        zr.Trainer(broken_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2))
    message = str(info.value)
    assert "RuntimeError: cannot build the model: vocab file 'vocab.json' not found" in message
    assert "worker traceback" in message and "in broken_model" in message  # the worker's own frames
    assert_released(live_actors() - actors, live_placement_groups() - pgs)  # nothing left running
    _record("model_fn raising RuntimeError", info.value)


def test_model_without_trainable_parameters(ray_local):
    with pytest.raises(ValueError, match="no trainable parameters") as info:
        zr.Trainer(frozen_model, lm_loss, scaling=zr.ScalingConfig(num_workers=1))
    _record("model with every parameter requires_grad=False", info.value)


def test_bad_batches_and_bad_losses(ray_local):
    batches = make_batches(2)
    with zr.Trainer(parity_model, picky_loss, zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(batches[0])

        idx, tgt = batches[1]
        # 13 rows over 2 workers split 7, 6 (tests/ray/test_uneven_batches.py); 1 row cannot split
        with pytest.raises(ValueError, match=r"1 rows, fewer than 2 worker\(s\) x 1 micro-batch") as info:
            trainer.step((idx[:1], tgt[:1]))
        _record("global batch of 1 row on 2 workers", info.value)

        # Rows of another shape than the last step's are no mistake (a padding collator's batches):
        # tests/ray/test_evaluate_run.py::test_trainer_steps_on_changing_sequence_lengths.

        with pytest.raises(StepError, match=r"step 1: loss_fn returned a non-finite loss \(nan\)") as info:
            trainer.step(_marked(NAN_MARK))
        _record("loss_fn returning nan (fp32)", info.value)

        # The rejected steps changed nothing: training continues.
        assert trainer.step(batches[1]).step == 2

        with pytest.raises(StepError, match=r"step 2: loss_fn must return a scalar tensor .* got \(6,\)") as info:
            trainer.step(_marked(VECTOR_MARK))
        _record("loss_fn returning a per-row loss of shape (6,)", info.value)
        assert trainer.step(batches[0]).step == 3

        # An error on one worker only: every worker learns of it from the step's status (the step
        # applies nowhere), the user's own error comes back, and the group goes on.
        with pytest.raises(KeyError, match="labels") as info:
            trainer.step(_marked(RAISE_MARK, rows=slice(6, None)))
        assert any(n.startswith("zeroray: raised on worker 1 (pid ") for n in info.value.__notes__)
        _record("loss_fn raising KeyError on worker 1 only", info.value)
        assert trainer.step(batches[0]).step == 4
