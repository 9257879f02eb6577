"""Fuzz cases trained by torch DDP (gloo, spawned processes): where the oracle's rules are DDP's.

The oracle (oracle.py) claims DDP's semantics: each worker's loss is the mean over its own
rows, gradients are averaged over workers, a parameter no worker used keeps ``.grad = None``
(AdamW skips it), buffers are rank 0's. This runs the same cases under
``DistributedDataParallel(find_unused_parameters=True)`` (buffers broadcast from rank 0 at
each forward, the default), with ``no_sync()`` on all but the last micro-batch, so a test can
show the two agree. DDP cannot run every case: a parameter read in ``loss_fn`` outside the
forward (the L2 term, ``h @ emb.weight.t()``) on a rank where the forward did not use it is
marked ready twice, which DDP refuses; cases given here must avoid that.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from typing import List

import cloudpickle
import torch

from tests.conformance.case import Case
from tests.dist.harness import spawn_ranks


def _worker(rank: int, world: int, blob: bytes, ports: List[int], out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroray.engine.batch import split_batch

    torch.set_num_threads(1)
    kept = []  # every case's DDP lives until the rank exits (harness._run_rank says why)
    for index, (case, port) in enumerate(zip(cloudpickle.loads(blob), ports)):
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        torch.manual_seed(case.seed)
        model = case.model_fn()()
        ddp = DDP(model, find_unused_parameters=True)
        kept.append(ddp)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **case.config.adamw)
        loss_fn, accum = case.loss_fn(), case.config.accum
        max_norm = case.config.zero.get("max_grad_norm") or float("inf")
        losses, unused = [], []
        for batch in case.batches:
            opt.zero_grad(set_to_none=True)
            micro = split_batch(split_batch(batch, world)[rank], accum)
            total = 0.0
            for m, mb in enumerate(micro):
                with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                    loss = loss_fn(ddp, mb)
                    (loss / accum).backward()
                total += loss.item() / accum
            unused.append([n for n, p in model.named_parameters() if p.requires_grad and p.grad is None])
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
            opt.step()
            losses.append(total)
        torch.save({"losses": losses, "unused": unused,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   os.path.join(out_dir, f"case{index}_rank{rank}.pt"))
        dist.destroy_process_group()


def run_ddp(world: int, cases: List[Case]) -> List[List[dict]]:
    """Per case, per rank: {"losses", "unused" (per step), "state" (after the last step)}."""
    from zeroray.comm.port import free_ports

    assert all(c.config.world == world for c in cases), "every case runs on all `world` ranks"
    with tempfile.TemporaryDirectory() as out_dir:
        ports = free_ports(len(cases))
        spawn_ranks(_worker, world, (world, cloudpickle.dumps(cases), ports), out_dir, join_s=300)
        return [[torch.load(os.path.join(out_dir, f"case{i}_rank{r}.pt"), weights_only=False) for r in range(world)]
                for i in range(len(cases))]
