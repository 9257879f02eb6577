"""The gloo point-to-point exchange against gloo's own collectives, in real gloo processes."""
import os
import tempfile
import time

import torch

from tests.dist.harness import record_failure, spawn_ranks
from zeroray.comm.group import TorchGroup, make_torch_group
from zeroray.comm.port import free_port


def _rank(rank, world, port, out_dir):
    try:
        torch.manual_seed(rank)
        native = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=3)
        p2p = TorchGroup(native.pg, rank, world, "gloo", point_to_point=True)
        native.exchange = None
        results = {}
        for n in (1, 7, 1000, 100003):  # per-rank row sizes, odd ones included
            full = torch.randn(world * n)
            want_rs, got_rs = torch.empty(n), torch.empty(n)
            native.reduce_scatter(want_rs, full)
            handle = p2p.reduce_scatter(got_rs, full, async_op=True, scratch=torch.empty(p2p.scratch_numel(n)))
            handle.wait()
            want_ag, got_ag = torch.empty(world * n), torch.empty(world * n)
            native.all_gather(want_ag, got_rs)
            p2p.all_gather(got_ag, got_rs)  # synchronous, and no scratch given to the next one
            p2p.reduce_scatter(torch.empty(n), full)
            results[n] = ((got_rs - want_rs).abs().max().item(), torch.equal(got_ag, want_ag))
            scratch_numel = p2p.all_reduce_scratch_numel(world * n)
            if scratch_numel:  # two ranks: stage 0's buckets exchange directly (all_reduce_pair)
                want_ar, got_ar = full.clone(), full.clone()
                native.all_reduce(want_ar)
                p2p.all_reduce(got_ar, async_op=True, scratch=torch.empty(scratch_numel)).wait()
                results[n] += (torch.equal(got_ar, want_ar), got_ar)
        # Several gathers in one exchange, each into its own output (comm/gather.py: no staging).
        inps = [torch.randn(n) for n in (3, 1000, 1, 257)]
        wants = [torch.empty(world * x.numel()) for x in inps]
        for want, x in zip(wants, inps):
            native.all_gather(want, x)
        gots = [torch.empty_like(w) for w in wants]
        p2p.all_gather_pieces(gots, inps, async_op=True).wait()
        results["pieces"] = (0.0, all(torch.equal(g, w) for g, w in zip(gots, wants)))
        results["pieces_native"] = (0.0, native.all_gather_pieces(gots, inps) is None)  # NCCL's way: staging
        p2p.counter.reset()
        launched = time.perf_counter()
        h = p2p.all_gather(torch.empty(world * 1000), torch.ones(1000), async_op=True)
        while not h.is_completed():  # the watcher completes it while this thread does other things
            time.sleep(0.005)
        seen_done = time.perf_counter() - launched
        time.sleep(0.3)  # work after completion: counted neither in comm_s nor in exposed
        h.wait()
        counter = (p2p.counter.wait_s, p2p.counter.comm_s, seen_done)
        # A receive whose sender never sends: gloo's timeout, raised by the caller's wait().
        error, t0 = None, time.perf_counter()
        if rank == 0:
            try:
                p2p.exchange.all_gather(torch.empty(world * 5), torch.ones(5)).wait()
            except RuntimeError as e:
                error = str(e)
            open(os.path.join(out_dir, "timed_out"), "w").close()
        else:
            # Stay connected (not sending) until rank 0's receive has timed out, however slow
            # the machine: closing first would end that receive with a reset, not a timeout.
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(out_dir, "timed_out")) and time.monotonic() < deadline:
                time.sleep(0.05)
        torch.save({"results": results, "counter": counter, "error": error, "error_s": time.perf_counter() - t0},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        p2p.close()
        native.close()
    except BaseException:
        record_failure(rank, out_dir)
        raise


def _run(world):
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank, world, (world, free_port()), out_dir, join_s=120)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def test_exchange_matches_gloo_collectives_and_times_and_times_out():
    for world in (2, 3):
        ranks = _run(world)
        for r, out in enumerate(ranks):
            for n, (rs_err, ag_equal, *all_reduce) in out["results"].items():
                assert rs_err <= 1e-5, (world, r, n, rs_err)
                assert ag_equal, (world, r, n)
                # the direct all-reduce of two ranks (the sized rows, not the pieces): gloo's sum,
                # the same bits on both ranks
                assert bool(all_reduce) == (world == 2 and isinstance(n, int)), (world, n, all_reduce)
                if all_reduce:
                    assert all_reduce[0], (world, r, n)
                    assert torch.equal(all_reduce[1], ranks[0]["results"][n][3]), (world, r, n)
            exposed, total, seen_done = out["counter"]
            # stamped when the watcher saw it complete, not when the caller came to wait: the
            # 0.3 s between completion and wait() count in neither
            assert total <= seen_done and exposed < 0.3, (exposed, total, seen_done)
        assert "Timed out" in ranks[0]["error"], ranks[0]["error"]
        assert 2.5 <= ranks[0]["error_s"] <= 10, ranks[0]["error_s"]
