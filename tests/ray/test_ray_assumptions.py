"""What zeroray's correctness rests on in Ray's behaviour, checked on real actors: a Ray release
that changes one of these fails here, naming the installed and the tested version, rather than
as a wrong snapshot in a fit. pyproject.toml pins Ray to the tested range; widen it only once
this module passes on the new release.

1. A value an actor method returns is written into the object store (a large one into the node's
   shared-memory store, a small one inline into the reply) before Ray drops its last reference to
   it. zeroray's in-memory snapshot returns numpy views of the live fp32 master and optimizer
   state (and a bf16 tensor as itself) and lets the next update overwrite that state as soon as
   the last reference is gone ([Note: overlapped snapshot copy] in zeroray/runtime/snapshot.py).
   Checked deterministically: the overwrite runs inside the release (``snapshot.on_release``, as
   the worker's does), so a store that came after the release would hold the overwritten values;
   a control that overwrites before the method returns shows that the check sees it.
2. The release comes: Ray lets go of the returned values once stored (else the next update, which
   waits for it, would wait forever).
3. The small record of a three-value call (``Worker.snapshot_shard``'s) resolves only once the
   large values beside it are stored: the driver takes a snapshot as complete when it holds the
   records ([Note: in-memory snapshots]).
4. A returned object outlives the actor that returned it, killed with SIGKILL: snapshots are in
   the object store, not in the worker's heap, so a worker's death keeps them ([Note: in-memory
   snapshots]).
5. An ObjectRef inside a list argument reaches the method unfetched (Ray's documented rule, which
   ``Worker.hold_copy`` relies on: a shard lost already is skipped, not a failed call), and
   ``ray.get`` of a large array gives a read-only view of the object store's copy (a buddy's view
   pins that copy on its node, [Note: buddy copies]; batch_transport copies it before user code
   sees it, [Note: batch transport]).

Checked end to end elsewhere: a returned object is stored on the node that ran the method and
served from a buddy's copy after that node dies (tests/ray/test_shrink_in_memory.py); Ray Data's
``streaming_split`` with ``preserve_order`` cuts the same splits every pass
(tests/ray/test_ray_data_replay.py). The snapshot's mechanism on a race is
tests/ray/test_snapshot_live.py.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray
import torch

from zeroray.runtime.worker.snapshot_side import on_release
from zeroray.runtime.worker.state_transfer import from_wire, to_wire

TESTED = "2.60.0"  # the Ray release these behaviours were read in (_raylet.pyx's execute_task) and tested with
LARGE = 4_000_000  # 16 MB of fp32: far above the 100 KiB under which Ray inlines a return value into its reply
SMALL = 1_000


def _changed(what: str) -> str:
    return (f"Ray {ray.__version__} (zeroray is tested with Ray {TESTED}) no longer {what}; zeroray's snapshot "
            "relies on it (see this module's docstring): keep Ray at the range pyproject.toml gives")


@ray.remote(max_concurrency=2)  # threaded, as zeroray's worker actor is
class LiveState:
    """An fp32 'master' and a bf16 tensor, exported live as Worker.snapshot_shard exports them."""

    def __init__(self, numel: int) -> None:
        self.master = torch.arange(numel, dtype=torch.float32)
        self.half = torch.arange(SMALL, dtype=torch.bfloat16)
        self.released = threading.Event()

    def _overwrite(self) -> None:  # the next update, in place
        self.master.fill_(-1.0)
        self.half.fill_(-1.0)
        self.released.set()

    def snapshot(self, overwrite_before_return: bool):
        wire = {"master": to_wire(self.master), "half": to_wire(self.half)}
        assert isinstance(wire["master"], np.ndarray) and isinstance(wire["half"], torch.Tensor)
        shard = {"tensors": wire, "scalars": {"step": 1}}
        if overwrite_before_return:
            try:
                return shard, None, {"step": 1}
            finally:
                self._overwrite()
        on_release(list(wire.values()), self._overwrite)
        del wire
        return shard, None, {"step": 1}

    def was_released(self, timeout_s: float) -> bool:
        return self.released.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def small_and_large(self):
        return np.arange(SMALL, dtype=np.float32), self.master.numpy()

    def receives(self, refs) -> str:
        return type(refs[0]).__name__


def _values(shard) -> tuple:
    t = shard["tensors"]
    return from_wire(t["master"]), from_wire(t["half"])


@pytest.mark.parametrize("numel", [LARGE, SMALL], ids=["object-store", "inline"])
def test_returned_live_state_is_stored_before_ray_lets_go_of_it(ray_local, numel):
    actor = LiveState.remote(numel)
    try:
        shard_ref, _, record_ref = actor.snapshot.options(num_returns=3).remote(False)
        assert ray.get(record_ref) == {"step": 1}
        ready, _ = ray.wait([shard_ref], timeout=0, fetch_local=False)
        assert ready, _changed("stores every value of a call before its small record resolves")
        master, half = _values(ray.get(shard_ref))
        assert torch.equal(master, torch.arange(numel, dtype=torch.float32)) and torch.equal(
            half, torch.arange(SMALL, dtype=torch.bfloat16)), _changed(
            "copies a returned value into the object store before it drops its last reference to it "
            "(the stored snapshot holds the state as overwritten after the release)")
        assert ray.get(actor.was_released.remote(30.0)), _changed(
            "drops its references to a returned value once it has stored it (the release never came)")
    finally:
        ray.kill(actor)


def test_the_check_sees_state_overwritten_before_the_store(ray_local):
    """The control: the same export with the overwrite before the method returns stores it."""
    actor = LiveState.remote(LARGE)
    try:
        shard_ref, _, _ = actor.snapshot.options(num_returns=3).remote(True)
        master, half = _values(ray.get(shard_ref))
        assert (master == -1).all() and (half == -1).all()
    finally:
        ray.kill(actor)


def test_returned_objects_outlive_the_actor_killed_with_sigkill(ray_local):
    actor = LiveState.remote(LARGE)
    small_ref, large_ref = actor.small_and_large.options(num_returns=2).remote()
    ray.wait([small_ref, large_ref], num_returns=2, fetch_local=False)
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=30)
    try:
        small, large = ray.get([small_ref, large_ref], timeout=60)
    except ray.exceptions.RayError as e:
        pytest.fail(_changed(f"keeps an actor's returned objects after the actor died ({type(e).__name__})"))
    assert np.array_equal(small, np.arange(SMALL, dtype=np.float32))
    assert np.array_equal(large, np.arange(LARGE, dtype=np.float32))


def test_a_nested_ref_arrives_unfetched_and_a_large_array_is_a_read_only_store_view(ray_local):
    ref = ray.put(np.arange(LARGE, dtype=np.float32))
    actor = LiveState.remote(SMALL)
    try:
        assert ray.get(actor.receives.remote([ref])) == "ObjectRef", _changed(
            "passes an ObjectRef nested in a list argument to the method as a ref")
    finally:
        ray.kill(actor)
    value = ray.get(ref)
    assert not value.flags.writeable and value.base is not None, _changed(
        "returns a large numpy array as a read-only view of the object store's copy")
    del ref  # the view keeps the store's copy alive (pinned) on its own
    assert value[-1] == LARGE - 1
