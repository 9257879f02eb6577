"""Several ranks on one GPU, for tests: collectives of device tensors through a CPU gloo group.

NCCL refuses two ranks on one device, so a single-GPU machine cannot run zeroray's
multi-rank code with CUDA tensors through NCCL. ``HostStagedGroup`` wraps a CPU group
(gloo): every collective copies its device input into a host tensor, runs on the host, and
copies the result back into the device tensor when the caller waits. The engine sees CUDA
tensors end to end (arena, buckets, shards, optimizer state, padding, shard ranges, the
stage-3 trace agreed across ranks), which is what this is for.

[Note: what host staging does not test]
- NCCL itself: communicator set-up, its streams, its timeouts and abort.
- Stream ordering: the device-to-host copy of an input blocks the host until the current
  stream has produced it, and the copy back happens on the caller's stream at ``wait()``. A
  collective that NCCL would read before compute wrote it (a missing event or stream wait)
  is correct here, so ordering bugs of the real path stay hidden.
- Overlap and speed: the copies are synchronous and the host does the reduction; figures
  taken through this group say nothing about the GPU path.
- Device-to-device transports (NVLink, P2P): nothing moves between GPUs.
So a passing multi-rank test here proves the sharding maths on CUDA tensors, not the NCCL
path; that one is checked at world size 1 through a real ProcessGroupNCCL
(benchmarks/gpu_check.py) and on machines with several GPUs.

It lives with the tests on purpose: it is not a way to train. Wiring it into the Ray
runtime (fractional ``num_gpus`` per worker) is a proposal in the issue, not built.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from zeroray.comm.group import Group, Handle


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy (always a copy, also of a CPU tensor: the CPU tests run the same path)."""
    return t.detach().to("cpu", copy=True)


class _StagedHandle:
    """Waits for the host collective, then copies each host result into its device tensor."""

    __slots__ = ("inner", "copies")

    def __init__(self, inner: Handle, copies: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner, self.copies = inner, copies  # (device destination, host source)

    def wait(self) -> None:
        self.wait_for(None)

    def wait_for(self, timeout_s: Optional[float]) -> bool:
        if self.inner is None:
            return True
        if timeout_s is None:
            self.inner.wait()
        elif not self.inner.wait_for(timeout_s):
            return False
        with torch.no_grad():
            for device_out, host_out in self.copies:
                device_out.copy_(host_out)
        self.inner, self.copies = None, []
        return True

    def is_completed(self) -> bool:
        """Done once wait() copied the results back (the device tensors hold them only then)."""
        return self.inner is None


class HostStagedGroup(Group):
    """``inner``'s collectives (a CPU group) on tensors of any device; see the module docstring.

    Counters are ``inner``'s: bytes and calls are those of the host collectives, which are the
    same tensors' sizes. The results of an async collective reach the device tensor only at
    ``wait()``, which is the contract of every handle zeroray uses.
    """

    def __init__(self, inner: Group) -> None:
        self.inner = inner
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter
        # The host group's ordering and waiting properties, and its signals, are this group's.
        self.independent_channels, self.blocking_waits = inner.independent_channels, inner.blocking_waits
        self.signal, self.signalled, self.clear_signal = inner.signal, inner.signalled, inner.clear_signal

    @staticmethod
    def _finish(inner: Handle, copies, async_op: bool) -> Handle:
        handle = _StagedHandle(inner, copies)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, out, inp, async_op=False, **order):  # order: channel, control (passed on)
        host_out = torch.empty(out.shape, dtype=out.dtype)
        # inp may be a view into out (an in-place gather): it is copied before anything is written.
        inner = self.inner.all_gather(host_out, _host(inp), async_op=True, **order)
        return self._finish(inner, [(out, host_out)], async_op)

    def reduce_scatter(self, out, inp, async_op=False, scratch: Optional[torch.Tensor] = None, **order):
        # The caller's scratch (sized by scratch_numel, 0 here) is never used: the host needs its own.
        numel = self.inner.scratch_numel(out.numel())
        host_scratch = torch.empty(numel, dtype=inp.dtype) if numel else None
        host_out = torch.empty(out.shape, dtype=out.dtype)
        inner = self.inner.reduce_scatter(host_out, _host(inp), async_op=True, scratch=host_scratch, **order)
        return self._finish(inner, [(out, host_out)], async_op)

    def all_reduce(self, t, op="sum", async_op=False, **order):
        host = _host(t)
        return self._finish(self.inner.all_reduce(host, op, async_op=True, **order), [(t, host)], async_op)

    def broadcast(self, t, src=0):
        host = _host(t)
        self.inner.broadcast(host, src)
        with torch.no_grad():
            t.copy_(host)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()
