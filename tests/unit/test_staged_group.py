"""HostStagedGroup's staging logic on the CPU: the host group only ever sees its own host
copies, and results reach the caller's tensors at wait(), not before (tests/staged_group.py)."""
import torch

from tests.staged_group import HostStagedGroup
from zeroray.comm.group import CommCounter, Group


class _Deferred:
    def __init__(self, run) -> None:
        self.run = run

    def wait(self) -> None:
        if self.run is not None:
            self.run()
            self.run = None


class TwinGroup(Group):
    """Rank 0 of two, whose peer holds the same tensors; the work happens at wait()."""

    def __init__(self, caller_storages) -> None:
        self.rank, self.world_size, self.counter = 0, 2, CommCounter()
        self.caller_storages = caller_storages  # data pointers the host group must never touch
        self.seen = []

    def _check(self, *tensors) -> None:
        for t in tensors:
            assert t.device.type == "cpu"
            assert t.untyped_storage().data_ptr() not in self.caller_storages
        self.seen.extend(tensors)

    def all_gather(self, out, inp, async_op=False):
        self._check(out, inp)
        return _Deferred(lambda: out.view(2, -1).copy_(torch.stack([inp, inp])))

    def scratch_numel(self, out_numel):
        return out_numel  # like gloo's exchange: the host group needs working space

    def reduce_scatter(self, out, inp, async_op=False, scratch=None):
        self._check(out, inp)
        assert scratch is not None and scratch.numel() == out.numel()
        return _Deferred(lambda: torch.mul(inp.view(2, -1)[self.rank], 2, out=out))

    def all_reduce(self, t, op="sum", async_op=False):
        self._check(t)
        return _Deferred(lambda: t.mul_(2))

    def broadcast(self, t, src=0):
        self._check(t)
        t.fill_(7)


def _staged(*caller):
    inner = TwinGroup({t.untyped_storage().data_ptr() for t in caller})
    return HostStagedGroup(inner), inner


def test_async_results_arrive_at_wait():
    inp, out = torch.arange(3.0), torch.zeros(6)
    group, inner = _staged(inp, out)
    handle = group.all_gather(out, inp, async_op=True)
    assert not handle.is_completed() and torch.equal(out, torch.zeros(6))
    handle.wait()
    assert handle.is_completed() and torch.equal(out, torch.arange(3.0).repeat(2))
    handle.wait()  # a second wait is harmless


def test_in_place_all_gather_reads_the_input_before_writing():
    full = torch.tensor([1.0, 2.0, 0.0, 0.0])
    group, _ = _staged(full)
    group.all_gather(full, full[:2])
    assert torch.equal(full, torch.tensor([1.0, 2.0, 1.0, 2.0]))


def test_reduce_scatter_uses_its_own_host_scratch():
    inp, out, device_scratch = torch.arange(4.0), torch.zeros(2), torch.full((2,), -1.0)
    group, _ = _staged(inp, out, device_scratch)
    assert group.scratch_numel(2) == 0  # the engine allocates no device scratch for it
    group.reduce_scatter(out, inp, scratch=device_scratch).wait()
    assert torch.equal(out, torch.tensor([0.0, 2.0])) and torch.equal(device_scratch, torch.full((2,), -1.0))
    assert torch.equal(inp, torch.arange(4.0))


def test_all_reduce_and_broadcast_write_back():
    t = torch.ones(3)
    group, inner = _staged(t)
    group.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 2.0))
    group.broadcast(t, src=0)
    assert torch.equal(t, torch.full((3,), 7.0))
    assert group.counter is inner.counter and (group.rank, group.world_size) == (0, 2)
