"""The polling waiter (comm/waiter.py): where waits block the host it waits in slices and polls in
between; elsewhere, or with nothing to poll, it waits once."""
from zeroray.comm.waiter import Waiter


class SlowHandle:
    """Completes after ``slices`` bounded waits (or ``checks`` completion checks)."""

    def __init__(self, slices: int = 0, checks: int = 0) -> None:
        self.slices, self.checks = slices, checks
        self.log = []

    def wait(self) -> None:
        self.log.append("wait")

    def wait_for(self, timeout_s: float) -> bool:
        self.log.append(("wait_for", timeout_s))
        self.slices -= 1
        return self.slices < 0

    def is_completed(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def polled(waiter):
    calls = []
    waiter.poll = lambda: calls.append("poll")
    return calls


def test_blocking_waits_are_sliced_and_polled_between_slices():
    waiter, handle = Waiter(blocking_waits=True, interval_s=0.25), SlowHandle(slices=2)
    calls = polled(waiter)
    waiter(handle)
    assert handle.log == [("wait_for", 0.25)] * 3
    assert calls == ["poll", "poll"]


def test_without_a_poll_or_on_non_blocking_waits_it_waits_once():
    handle = SlowHandle(slices=2)
    Waiter(blocking_waits=True)(handle)
    assert handle.log == ["wait"]
    waiter, handle = Waiter(blocking_waits=False), SlowHandle(slices=2)
    calls = polled(waiter)
    waiter(handle)
    assert handle.log == ["wait"] and calls == []


def test_until_complete_polls_until_done_where_waits_do_not_block():
    waiter, handle = Waiter(blocking_waits=False), SlowHandle(checks=3)
    calls = polled(waiter)
    waiter.until_complete(handle)
    assert calls == ["poll"] * 3 and handle.log == ["wait"]


def test_until_complete_on_blocking_waits_is_a_sliced_wait():
    waiter, handle = Waiter(blocking_waits=True, interval_s=0.5), SlowHandle(slices=1, checks=99)
    calls = polled(waiter)
    waiter.until_complete(handle)
    assert handle.log == [("wait_for", 0.5)] * 2 and calls == ["poll"]


def test_a_poll_that_raises_ends_the_wait():
    waiter, handle = Waiter(blocking_waits=True), SlowHandle(slices=5)

    def poll():
        raise RuntimeError("a peer left the plan")
    waiter.poll = poll
    try:
        waiter(handle)
    except RuntimeError as error:
        assert str(error) == "a peer left the plan"
    else:
        raise AssertionError("the poll's error did not end the wait")
    assert handle.log == [("wait_for", 0.05)]
