"""The coordinator's lifecycle (fetch/lifecycle.py): one ``Phase``, moved by the engine's calls.

Driven directly, stage 0's coordinator (the lifecycle alone) goes through a step, a failed step
and an inference call, and a call in a phase that does not allow it is an AssertionError. Through
real engines in one process: each stage builds its own coordinator (fetch/build.py), only stage 3
gets its unit events installed into the gradient and saved-tensor hooks, the phase a module's
forward sees is FORWARD, and in the recomputation of activation checkpointing BACKWARD, and
every step, failed ones included, ends IDLE.
"""
import functools

import pytest
import torch

import zeroray as zr
from examples import gpt
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.fetch.lifecycle import MOVES, Coordinator, Phase
from zeroray.fetch.publish import UpdatePublisher
from zeroray.fetch.unit_fetcher import UnitFetcher

I, F, B, C = Phase.IDLE, Phase.FORWARD, Phase.BACKWARD, Phase.COMPUTED
CFG = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=8)


def walk(coord, calls):
    """Make ``calls`` (name, *args) on ``coord``; the phase after each."""
    phases = []
    for name, *args in calls:
        getattr(coord, name)(*args)
        phases.append(coord.phase)
    return phases


MICRO_BATCH = [("begin_micro_batch", 0), ("begin_backward",), ("finish_backward",), ("end_micro_batch",)]


def test_a_step_of_two_micro_batches_and_an_inference_call():
    coord = Coordinator()
    step = [("begin_step",), *MICRO_BATCH, ("begin_micro_batch", 1), ("begin_backward",), ("finish_backward",),
            ("end_micro_batch",), ("status",), ("end_step", False, False, True)]
    assert walk(coord, step) == [I, F, B, C, C, F, B, C, C, C, I]
    assert coord.status() == (0.0, 0.0, 0.0) and coord.stats == {}  # no trace, no fetch counters
    assert walk(coord, [("begin_inference",), ("end_inference",)]) == [F, I]
    assert walk(coord, step) == [I, F, B, C, C, F, B, C, C, C, I]  # the call left nothing behind


@pytest.mark.parametrize("failed_in", ["split", "forward", "backward", "reductions"])
def test_a_failed_step_begins_the_micro_batches_it_did_not_reach(failed_in):
    coord = Coordinator()
    reached = {"split": [], "forward": MICRO_BATCH[:1], "backward": MICRO_BATCH[:2], "reductions": MICRO_BATCH[:3]}
    walk(coord, [("begin_step",), *reached[failed_in]])
    # Engine._abort: every micro-batch from the failing one on, begun here if it was not
    for i in range(2):
        coord.abort_micro_batch(i)
        assert (coord.phase, coord.micro_batch) == (C, i)
        coord.end_micro_batch()
    coord.end_step(failed=True, any_exit=False, agreed=True)
    assert coord.phase is I


@pytest.mark.parametrize("before, call, phase", [
    ([], ("begin_backward",), "IDLE"),
    ([], ("end_micro_batch",), "IDLE"),
    ([("begin_step",)], ("end_step", False, False, True), "IDLE"),
    ([("begin_step",), ("begin_micro_batch", 0)], ("finish_backward",), "FORWARD"),
    ([("begin_step",), ("begin_micro_batch", 0)], ("end_step", False, False, True), "FORWARD"),
    ([("begin_step",), ("begin_micro_batch", 0)], ("begin_inference",), "FORWARD"),
    ([("begin_step",), *MICRO_BATCH[:2]], ("end_micro_batch",), "BACKWARD"),
    ([("begin_step",), *MICRO_BATCH[:2]], ("begin_micro_batch", 1), "BACKWARD"),
    ([("begin_step",), *MICRO_BATCH], ("begin_step",), "COMPUTED"),
    ([("begin_inference",)], ("begin_step",), "FORWARD"),
])
def test_a_call_in_a_phase_that_does_not_allow_it_is_a_bug(before, call, phase):
    coord = Coordinator()
    walk(coord, before)
    with pytest.raises(AssertionError, match=rf"Coordinator\.{call[0]} in phase {phase}"):
        walk(coord, [call])


def test_the_moves_name_the_lifecycle_and_reach_every_phase():
    internal = {"finish_inference"}  # end_inference's first half
    assert {call for call in MOVES if call not in internal} <= set(dir(Coordinator))
    assert {to for _, to in MOVES.values()} == set(Phase)
    assert all(allowed for allowed, _ in MOVES.values())


def _engine(stage, loss_fn=gpt.gpt_loss):
    return Engine(functools.partial(gpt.GPT, CFG), loss_fn, zr.AdamW(lr=1e-3),
                  zr.ZeroConfig(stage=stage, activation_checkpointing=True), SoloGroup())


@pytest.mark.parametrize("stage, kind", [(0, Coordinator), (1, UpdatePublisher), (2, UpdatePublisher),
                                         (3, UnitFetcher)])
def test_each_stage_has_its_coordinator_and_only_stage_3_is_installed(stage, kind):
    engine = _engine(stage)
    assert type(engine.coordinator) is kind
    installed = engine.coordinator if stage == 3 else None
    assert engine.activations.inner is installed  # the saved-tensor hooks' pack/unpack
    assert engine.grads.unit_events is installed  # a unit's last gradient
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_forward_and_recomputation_see_their_phases_and_every_step_ends_idle(stage):
    fail = {"now": False}

    def loss_fn(model, batch):
        if fail["now"]:
            raise ValueError("this step's loss_fn raised")
        return gpt.gpt_loss(model, batch)

    engine = _engine(stage, loss_fn)
    seen = []
    engine.model.blocks[0].fc.register_forward_pre_hook(lambda m, a: seen.append(engine.coordinator.phase))
    batches = list(gpt.CharBatches(4, CFG.seq_len, 3, seed=1))
    engine.train_step(batches[0])
    assert seen == [F, B]  # the block's forward, then its recomputation in backward (it is checkpointed)
    assert engine.coordinator.phase is I
    fail["now"] = True
    with pytest.raises(ValueError, match="this step's loss_fn raised"):
        engine.train_step(batches[1])
    assert engine.coordinator.phase is I
    fail["now"] = False
    engine.train_step(batches[2])
    assert engine.coordinator.phase is I and engine.step_count == 2
    engine.evaluate(batches[0])
    assert engine.coordinator.phase is I
    engine.close()
