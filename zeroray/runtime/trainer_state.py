"""What the trainer is doing (``TrainerState``) and the one table of the moves between states.

The Controller (controller/controller.py) holds one ``StateMachine`` and changes its state only through
it; [Note: trainer states] there says which of its methods makes which move. Pure: testable
without a cluster (tests/unit/test_trainer_state.py).
"""
from __future__ import annotations

import enum
from typing import Dict, FrozenSet


class TrainerState(enum.Enum):
    """What the trainer is doing; see [Note: trainer states] in controller/controller.py."""

    IDLE = "idle"
    STEPPING = "stepping"
    FITTING = "fitting"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    EVALUATING = "evaluating"
    RUNNING = "running"
    CLOSED = "closed"


_S = TrainerState
# state -> the states it may move to. Every state may close (close() from anywhere, and again
# once closed); a recovery that could not restart ends CLOSED.
TRANSITIONS: Dict[TrainerState, FrozenSet[TrainerState]] = {
    _S.IDLE: frozenset({_S.STEPPING, _S.FITTING, _S.RESIZING, _S.EVALUATING, _S.RUNNING, _S.CLOSED}),
    _S.STEPPING: frozenset({_S.IDLE, _S.CLOSED}),
    _S.FITTING: frozenset({_S.RECOVERING, _S.IDLE, _S.CLOSED}),
    _S.RECOVERING: frozenset({_S.FITTING, _S.CLOSED}),
    _S.RESIZING: frozenset({_S.IDLE, _S.CLOSED}),
    _S.EVALUATING: frozenset({_S.IDLE, _S.CLOSED}),
    _S.RUNNING: frozenset({_S.IDLE, _S.CLOSED}),
    _S.CLOSED: frozenset({_S.CLOSED}),
}

SHUT_DOWN = "this Trainer was shut down: build a new one (or zr.Trainer.restore(...))"


class StateMachine:
    """The trainer's state; ``enter`` makes a move the table allows or raises a RuntimeError
    that says what the trainer is doing."""

    def __init__(self) -> None:
        self._state = TrainerState.IDLE

    @property
    def state(self) -> TrainerState:
        return self._state

    def enter(self, state: TrainerState) -> None:
        if state not in TRANSITIONS[self._state]:
            if self._state is TrainerState.CLOSED:
                raise RuntimeError(SHUT_DOWN)
            raise RuntimeError(f"cannot start {state.value} while the Trainer is {self._state.value}: "
                               "wait until that returns (a Trainer does one thing at a time)")
        self._state = state

    def leave(self, state: TrainerState, to: TrainerState = TrainerState.IDLE) -> None:
        """End ``state`` (if still in it: a close or a failed recovery may have ended it already)."""
        if self._state is state:
            self.enter(to)
