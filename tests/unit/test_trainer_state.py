"""The trainer's state machine (runtime/trainer_state.py): every move in the one table, close and
recovery included; an illegal move is refused with what the trainer is doing."""
import pytest

from zeroray.runtime.trainer_state import TRANSITIONS, StateMachine, TrainerState as S


def at(*moves):
    machine = StateMachine()
    for state in moves:
        machine.enter(state)
    return machine


def test_every_state_may_close_and_close_twice_stays_closed():
    for state in S:
        assert S.CLOSED in TRANSITIONS[state], state
    machine = at(S.FITTING, S.RECOVERING, S.CLOSED)
    machine.enter(S.CLOSED)
    assert machine.state is S.CLOSED


def test_recovery_goes_through_the_table():
    machine = at(S.FITTING, S.RECOVERING)
    machine.leave(S.RECOVERING, S.FITTING)  # restarted
    assert machine.state is S.FITTING
    machine.enter(S.RECOVERING)
    machine.enter(S.CLOSED)  # could not restart: no group left
    machine.leave(S.FITTING)  # fit's own end finds it closed already: nothing to leave
    assert machine.state is S.CLOSED


@pytest.mark.parametrize("moves, illegal, says", [
    ((S.FITTING,), S.STEPPING, "cannot start stepping while the Trainer is fitting"),
    ((), S.RECOVERING, "cannot start recovering while the Trainer is idle"),
    ((S.STEPPING,), S.FITTING, "cannot start fitting while the Trainer is stepping"),
    ((S.FITTING, S.RECOVERING), S.IDLE, "cannot start idle while the Trainer is recovering"),
    ((S.CLOSED,), S.IDLE, "shut down"),
    ((S.CLOSED,), S.STEPPING, "shut down"),
])
def test_an_illegal_move_is_refused(moves, illegal, says):
    machine = at(*moves)
    before = machine.state
    with pytest.raises(RuntimeError, match=says):
        machine.enter(illegal)
    assert machine.state is before


def test_only_the_table_moves_it():
    machine = StateMachine()
    with pytest.raises(AttributeError):
        machine.state = S.CLOSED
    for state, targets in TRANSITIONS.items():
        assert targets <= set(S) and (state is S.CLOSED or S.IDLE in targets or state is S.IDLE
                                      or state is S.RECOVERING), state
