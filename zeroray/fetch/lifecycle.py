"""The coordinator's lifecycle: the phases of a step every stage goes through, and stage 3's extra events.

The engine drives its coordinator through each step (``begin_step``; per micro-batch
``begin_micro_batch``, ``begin_backward``, ``finish_backward`` or ``abort_micro_batch``,
``end_micro_batch``; then ``status`` and ``end_step``) and each inference call
(``begin_inference``, ``end_inference``), with the same calls at every stage. ``Coordinator``
keeps the one state those calls put it in, its ``Phase``, and asserts that each call comes in a
phase that allows it. Each stage's coordinator extends it with what its stage does at those
points (fetch/build.py builds the stage's coordinator):

- stage 0: ``Coordinator`` itself. Every parameter is resident, so nothing is fetched: the calls
  only move the phase.
- stages 1-2: ``UpdatePublisher`` (fetch/publish.py) starts the gathers that publish the
  optimizer's update, and waits for each where it is first needed.
- stage 3: ``UnitFetcher`` (fetch/unit_fetcher.py) gathers and frees every unit around its use.

Only stage 3 hears more than the lifecycle. Its ``UnitEvents`` (a unit's last gradient, a
checkpointed module's recomputation, saved views of its units) come from parts of the engine
it is installed into (engine/grad_intake.py, engine/activations.py), and only where stage 3
exists: stages 0-2 have nothing installed there. Module hooks, parameter reads and the
waiter's poll are hooked by each coordinator itself.
"""
from __future__ import annotations

import enum
from typing import Dict, FrozenSet, Optional, Protocol, Tuple

import torch


class Phase(enum.Enum):
    """Where a coordinator is in the engine's step or inference call (FSDP2's ``TrainingState``).

    IDLE: no micro-batch is open: between steps and inference calls, and in a step before its
        first micro-batch begins. Stage 3 records no event, and a read of a parameter whose unit
        is sharded is an error (``ParameterAccessError``); stages 1-2 wait for no module's units.
    FORWARD: a micro-batch began (or an inference call): ``loss_fn`` (or the call's function)
        runs; module hooks and parameter reads are the micro-batch's events.
    BACKWARD: the micro-batch's backward runs: autograd unpacks saved views of units, and a
        checkpointed module's recomputation fetches its own units.
    COMPUTED: this rank's forward and backward of the micro-batch are over, or abandoned (its
        code raised), or the inference call's function returned. What is left is what its peers
        still expect of it (stage 3's rounds and the rest of the plan's gathers), the
        reductions, and after the last micro-batch the step's status. The phase stays until
        the next micro-batch begins or the step ends.

    The calls move it as ``MOVES`` says (the phases each may come in -> the phase it leaves):

        begin_step          IDLE                        -> IDLE
        begin_micro_batch   IDLE, COMPUTED              -> FORWARD
        begin_backward      FORWARD                     -> BACKWARD
        finish_backward     BACKWARD                    -> COMPUTED
        abort_micro_batch   FORWARD, BACKWARD, COMPUTED -> COMPUTED (a micro-batch the step
                            failed before begins first: IDLE or COMPUTED -> FORWARD)
        end_micro_batch     COMPUTED                    -> COMPUTED
        end_step            COMPUTED                    -> IDLE
        begin_inference     IDLE                        -> FORWARD
        finish_inference    FORWARD                     -> COMPUTED (end_inference's first half)
        end_inference       COMPUTED, IDLE              -> IDLE

    Any other call in a phase is a bug in its caller: an ``AssertionError``. One move is
    outside the table: stage 3 goes to IDLE from any phase when it finds that the ranks
    diverged where they cannot negotiate (``UnrecoverableDivergence``, [Note: plan exit] in
    fetch/unit_fetcher.py). The group is broken and the engine is discarded; IDLE lets the rest
    of the failing call ignore events, and lets ``end_inference`` end from IDLE.
    """

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    COMPUTED = "computed"


_I, _F, _B, _C = Phase.IDLE, Phase.FORWARD, Phase.BACKWARD, Phase.COMPUTED
# call -> (the phases it may come in, the phase it leaves); see Phase's docstring.
MOVES: Dict[str, Tuple[FrozenSet[Phase], Phase]] = {
    "begin_step": (frozenset({_I}), _I),
    "begin_micro_batch": (frozenset({_I, _C}), _F),
    "begin_backward": (frozenset({_F}), _B),
    "finish_backward": (frozenset({_B}), _C),
    "abort_micro_batch": (frozenset({_F, _B, _C}), _C),
    "end_micro_batch": (frozenset({_C}), _C),
    "end_step": (frozenset({_C}), _I),
    "begin_inference": (frozenset({_I}), _F),
    "finish_inference": (frozenset({_F}), _C),
    "end_inference": (frozenset({_C, _I}), _I),
}


class Coordinator:
    """The phases of the engine's steps and inference calls; on its own, stage 0's coordinator.
    Each call asserts the phase it comes in and moves to the next (see ``Phase``). A stage's
    coordinator extends the calls with its own work, calling these where its work needs the
    new phase (stage 3 launches a micro-batch's reductions before it is COMPUTED)."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.micro_batch: Optional[int] = None  # the micro-batch begun last in this step (an inference call: 0)
        self.stats: Dict[str, float] = {}        # the last step's fetch counters (stage 3 counts)

    def _move(self, call: str) -> None:
        allowed, to = MOVES[call]
        assert self.phase in allowed, f"{type(self).__name__}.{call} in phase {self.phase.name}"
        self.phase = to

    def _abandon(self) -> None:
        """The group is broken (stage 3: the ranks diverged where they cannot negotiate): IDLE
        from any phase, so that the rest of the failing call ignores events; see ``Phase``."""
        self.phase = Phase.IDLE

    def _began(self, micro_batch: int) -> bool:
        return self.micro_batch is not None and self.micro_batch >= micro_batch

    # --- a step ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._move("begin_step")
        self.micro_batch = None

    def begin_micro_batch(self, micro_batch: int) -> None:
        self._move("begin_micro_batch")
        self.micro_batch = micro_batch

    def begin_backward(self) -> None:
        self._move("begin_backward")

    def finish_backward(self) -> None:
        """This rank's backward is over, before the micro-batch's reductions are waited for."""
        self._move("finish_backward")

    def abort_micro_batch(self, micro_batch: int) -> None:
        """This rank stops computing ``micro_batch`` (its code raised in it, or before it
        began: then it begins here), and takes part in what its peers still expect of it
        ([Note: step outcome] in errors.py)."""
        if not self._began(micro_batch):
            self.begin_micro_batch(micro_batch)
        self._move("abort_micro_batch")

    def end_micro_batch(self) -> None:
        """After the micro-batch's reductions."""
        self._move("end_micro_batch")

    def status(self) -> Tuple[float, float, float]:
        """(left the plan, events, digest) for the step's status all-reduce ([Note: step status]
        in engine/step_status.py): no trace to agree on, nothing left (stage 3 has one)."""
        return 0.0, 0.0, 0.0

    def end_step(self, failed: bool, any_exit: bool, agreed: bool) -> None:
        """After the step's status all-reduce: whether a rank ``failed``, whether any left the
        plan, and whether every rank recorded the same events (stage 3 reads the last two)."""
        self._move("end_step")

    # --- an inference call: [Note: inference calls] in engine/inference.py ----------------------

    def begin_inference(self) -> None:
        """Before ``evaluate``/``run`` computes."""
        self._move("begin_inference")
        self.micro_batch = 0

    def end_inference(self) -> None:
        """After ``evaluate``/``run`` computed (or raised)."""
        if self.phase is Phase.FORWARD:
            self._move("finish_inference")
        self._move("end_inference")

    # --- between calls ---------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every parameter gather in flight: stage 0 gathers nothing."""

    def remove(self) -> None:
        """Give the model back as it was built: stage 0 attached nothing to it."""


class UnitEvents(Protocol):
    """What stage 3's coordinator hears beyond the lifecycle, from the engine's parts it is
    installed into (only at stage 3: fetch/build.py returns None at stages 0-2)."""

    def on_grads_done(self, unit: int) -> None:
        """Every gradient of ``unit`` reached the reducer (engine/grad_intake.py)."""

    def enter_module(self, module: torch.nn.Module) -> bool:
        """A checkpointed ``module`` is about to run (engine/activations.py); True: call
        ``exit_module`` after it."""

    def exit_module(self, module: torch.nn.Module) -> None:
        """A checkpointed ``module`` that ``enter_module`` took returned."""

    def pack(self, t: torch.Tensor):
        """Autograd saves ``t`` (the saved-tensor hooks of engine/activations.py)."""

    def unpack(self, obj):
        """Autograd reads back what ``pack`` returned."""
