"""Closing the gloo point-to-point exchange joins its watcher threads within the collective timeout.

[Note: gloo point-to-point] in zeroray/comm/exchange.py. Two real gloo processes. Rank 0 uses
three channels, then posts an all-gather on each that rank 1 never answers (rank 1 stays
connected, so each receive can only end by gloo's timeout), and closes the group at once: every
watcher is joined, within about one timeout in all (not one per busy channel), and no
``zeroray-exchange`` thread is left. Closing an idle exchange takes no time.
"""
import os
import tempfile
import threading
import time

import torch

from tests.dist.harness import record_failure, spawn_ranks
from zeroray.comm.group import make_torch_group
from zeroray.comm.port import free_ports

TIMEOUT_S = 2.0


def _watchers():
    return [t.name for t in threading.enumerate() if t.name.startswith("zeroray-exchange") and t.is_alive()]


def _rank(rank, ports, out_dir):
    try:
        results = {}
        for phase in ("idle", "busy"):
            group = make_torch_group("gloo", rank, 2, "127.0.0.1", ports[phase], timeout_s=TIMEOUT_S)
            for channel in (0, 1, 2):  # one answered exchange per channel: three watchers
                group.exchange.all_gather(torch.empty(2 * 8), torch.ones(8), channel=channel).wait()
            if phase == "busy":
                if rank == 0:
                    for channel in (0, 1, 2):  # never answered by rank 1
                        group.exchange.all_gather(torch.empty(2 * 8), torch.ones(8), channel=channel)
                else:  # connected and silent until rank 0 is done
                    deadline = time.monotonic() + 60
                    while not os.path.exists(os.path.join(out_dir, "closed")) and time.monotonic() < deadline:
                        time.sleep(0.05)
            before = len(_watchers())
            t0 = time.perf_counter()
            group.close()
            results[phase] = (before, time.perf_counter() - t0, _watchers())
            if phase == "busy" and rank == 0:
                open(os.path.join(out_dir, "closed"), "w").close()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        record_failure(rank, out_dir)
        raise


def test_close_joins_every_watcher_within_the_timeout():
    with tempfile.TemporaryDirectory() as out_dir:
        ports = dict(zip(("idle", "busy"), free_ports(2)))
        spawn_ranks(_rank, 2, (ports,), out_dir, join_s=120)
        results = torch.load(os.path.join(out_dir, "rank0.pt"))
    idle, busy = results["idle"], results["busy"]
    print(f"\n  close, idle: {idle[1] * 1e3:.1f} ms; with 3 receives in flight: {busy[1]:.2f} s "
          f"(collective timeout {TIMEOUT_S} s)")
    assert idle[0] == 3 and idle[2] == [] and idle[1] < 1.0
    assert busy[0] == 3 and busy[2] == []
    assert busy[1] <= TIMEOUT_S + 1.5  # one timeout for all three channels, not three
