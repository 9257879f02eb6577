"""Why a process set's rendezvous ports are drawn distinct ([Note: ports drawn together] in
zeroray/comm/port.py): the store of a finished rendezvous still listens in that set."""
import socket

import torch.multiprocessing as mp

from zeroray.comm.port import free_port


def _keep_a_finished_default_group(rank, port, out):
    from zeroray.comm.group import make_torch_group
    from zeroray.comm.user_group import join_default_group, leave_default_group

    group = make_torch_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=60)
    join_default_group(group, "gloo", 60)
    kept = leave_default_group()  # as the tests' process sets keep it (tests/dist/harness.py)
    group.close()
    del group
    if rank == 0:
        with socket.socket() as s:
            try:
                s.bind(("", port))
                out.put("free")
            except OSError:
                out.put("in use")
    else:
        out.get(timeout=120)  # hold rank 1 (and its connections) until rank 0 has looked
    del kept


def test_a_kept_default_group_keeps_its_store_port_in_use():
    """Why distinct draws matter: the port of a finished rendezvous is still taken in its set."""
    ctx = mp.get_context("spawn")
    to_rank1, seen = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_keep_a_finished_default_group, args=(r, port, seen if r == 0 else to_rank1))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        answer = seen.get(timeout=120)
        to_rank1.put("done")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert answer == "in use"
