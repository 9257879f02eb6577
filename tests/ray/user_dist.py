"""What torch.distributed looks like from the user's code on the workers: a ``trainer.run`` fn
that gathers every rank's view, and the check that it is one group of the trainer's workers
([Note: torch.distributed in user code] in zeroray/comm/user_group.py)."""
import os

import torch
import torch.distributed as dist

import zeroray as zr


def dist_view(model):
    """``trainer.run`` fn: every rank's view of torch.distributed, gathered over it to rank 0."""
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    context = zr.worker_context()
    mine = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(), "pid": os.getpid(),
            "context": (context.rank, context.world_size), "built": getattr(model, "built", None),
            "calls": list(getattr(model, "calls", []))}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def check_group(views, world):
    """The views of ``dist_view``: ranks 0..world-1 of one group of ``world``, as zeroray numbers them."""
    assert [v["rank"] for v in views] == list(range(world)), views
    assert all(v["world"] == world and v["sum"] == world * (world + 1) / 2 for v in views), views
    assert all(v["context"] == (v["rank"], world) for v in views), views  # zeroray.worker_context() agrees
