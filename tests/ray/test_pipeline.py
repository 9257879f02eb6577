"""fit keeps the next step in flight ([Note: pipelined steps]) without changing what fit means, and
every worker runs engine calls in the driver's order, one at a time, while still answering polls
([Note: one engine call at a time]). Ray Data input overlaps the same way: tests/ray/test_ray_data.py.

Each step's StepResult carries its timeline (driver submit, call arrived at rank 0's actor,
engine start/end there, driver receive, all ``time.time()`` on this machine). Steps here sleep
in loss_fn, so "the next call had arrived before the current step ended" cannot be a race.
"""
import os
import threading
import time

import pytest
import ray
import torch

import zeroray as zr
from tests.models import VOCAB, lm_loss, make_batches, parity_model, reference_run
from zeroray.checkpoint import full_state_dict
from zeroray.runtime.failures import WorkerTraceback
from zeroray.runtime.worker.sequencer import Cancelled, Sequencer, Ticket

SLOW_S = 0.25      # every step sleeps this long in loss_fn
RAISE_MARK = VOCAB - 3  # a global batch made only of this token raises in loss_fn, on every worker
EVERY = 2
OPT = dict(lr=1e-2, weight_decay=0.1)


def slow_loss(model, batch):
    idx, tgt = batch
    if bool((idx == RAISE_MARK).all()):
        raise KeyError("labels")
    time.sleep(SLOW_S)
    return lm_loss(model, batch)


def _reference(batches):
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)  # noqa: E731
    return reference_run(parity_model, lm_loss, make_opt, batches)


def _marked():
    idx, tgt = make_batches(1, seed=5)[0]
    return torch.full_like(idx, RAISE_MARK), tgt


# --- the sequencer, without Ray ---------------------------------------------------------------


def test_sequencer_runs_calls_in_ticket_order_and_cancels_behind_a_failure():
    sequencer, ran, out = Sequencer(), [], {}

    def call(seq, after_ok=False, fail=False):
        def body():
            ran.append(seq)
            if fail:
                raise KeyError(seq)
            return seq
        try:
            out[seq] = sequencer.run(Ticket(seq, after_ok), body)
        except KeyError as error:
            out[seq] = error

    plan = [(0, False, False), (1, False, True), (2, True, False), (3, True, False), (4, False, False),
            (5, True, False)]
    threads = [threading.Thread(target=call, args=p) for p in reversed(plan)]  # delivered in reverse
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(10)
    # In ticket order; 2 waited for 1 and was cancelled, so was 3 behind it; 4 runs regardless, 5 after 4.
    assert ran == [0, 1, 4, 5]
    assert isinstance(out[1], KeyError) and isinstance(out[2], Cancelled) and isinstance(out[3], Cancelled)
    assert out[0] == 0 and out[4] == 4 and out[5] == 5 and not sequencer.busy


# --- with workers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    with zr.Trainer(parity_model, slow_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2),
                    checkpoint=zr.CheckpointConfig(path=str(root / "ckpt"), every_steps=EVERY, keep=5)) as t:
        yield t


def test_fit_keeps_the_next_step_in_flight_and_a_checkpoint_waits_for_its_step(trainer):
    batches = make_batches(8)
    results = trainer.fit(batches[:5], progress=False)
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    ref_losses, _, _ = _reference(batches[:5])
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
    for now, after in zip(results, results[1:]):
        if now.step % EVERY:
            # The next step's call was on the worker before this one's engine work ended.
            assert after.timeline["actor_start"] < now.timeline["engine_end"], (now.timeline, after.timeline)
        else:
            # A checkpoint step: the next one is sent only once its result is in and the save done.
            assert after.timeline["submit"] > now.timeline["receive"], (now.timeline, after.timeline)
    # Each checkpoint holds the weights of exactly its step, not of a step queued behind it.
    root = trainer.checkpoint_config.path
    for step in (2, 4):
        saved = full_state_dict(os.path.join(root, f"step_{step:08d}"))
        want = _reference(batches[:step])[2]
        assert max((saved[k] - v).abs().max().item() for k, v in want.items()) <= 1e-5, step


def test_a_failed_step_cancels_the_step_behind_it_and_training_goes_on(trainer):
    batches = make_batches(8)
    start = trainer.step_count
    pids = [w["pid"] for w in trainer.workers]
    # Every worker's loss_fn raises in the second step of this fit; the third was already queued.
    data = [batches[start], _marked(), batches[start + 1], batches[start + 2]]
    with pytest.raises(KeyError) as info:
        trainer.fit(data, skip=0, progress=False)
    error = info.value
    print(f"\n  a worker's error as the user sees it: {type(error).__name__}: {error}; notes {error.__notes__}")
    assert type(error) is KeyError and str(error) == "'labels'"  # the user's own exception, message first
    assert not isinstance(error, ray.exceptions.RayTaskError)
    assert any(n.startswith("zeroray: raised on worker 0 (pid ") and f"during step {start + 1}" in n
               for n in error.__notes__), error.__notes__
    assert isinstance(error.__cause__, WorkerTraceback) and "in slow_loss" in str(error.__cause__)
    # The step behind the failed one never ran: the next step trains on top of step start + 1.
    assert trainer.step_count == start + 1 and trainer.data_position == 1
    assert [w["pid"] for w in trainer.workers] == pids  # the group was not torn down
    result = trainer.step(batches[start + 1])
    assert result.step == start + 2
    want = _reference(batches[:start + 2])[0][-1]
    assert result.loss == pytest.approx(want, rel=1e-5)


def test_polls_are_answered_during_a_step(trainer):
    batches = make_batches(3, seed=11)
    group = trainer.controller.group
    fitting = threading.Thread(target=trainer.fit, args=(batches,), kwargs={"skip": 0, "progress": False})
    fitting.start()
    try:
        seen = []
        deadline = time.monotonic() + 60
        while fitting.is_alive() and time.monotonic() < deadline:
            t0 = time.monotonic()
            progress = ray.get(group.poll("progress"), timeout=30)
            seen.append((time.monotonic() - t0, [p["busy"] for p in progress]))
            time.sleep(0.05)
    finally:
        fitting.join(120)
    busy = [took for took, flags in seen if all(flags)]
    print(f"\n  {len(seen)} progress polls during fit, {len(busy)} while every worker was in a step; "
          f"slowest answer {max(t for t, _ in seen) * 1e3:.0f} ms")
    assert busy and max(busy) < SLOW_S  # answered mid-step, not after it

