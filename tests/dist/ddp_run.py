"""torch DDP (gloo) training of a harness spec, on one rank: the parity tests' second reference.

A spec with ``"ddp": True`` (tests/dist/harness.py) trains ``model_fn`` under
``DistributedDataParallel`` on the same global batches as zeroray's runs: each rank's loss is
``loss_fn`` on its share (``split_batch``), DDP averages the gradients over the ranks, clipping
by the global norm where ``max_grad_norm`` is set, micro-batches under ``no_sync``. Its distance
from single-process PyTorch is what float reordering alone moves a run by: [Note: parity bound]
in tests/dist/parity.py.

Spec keys: ``model_fn``, ``loss_fn``, ``optimizer`` (zeroray's optimizer spec, the same as the
engine's runs: an object with ``build(params)``, or ``params -> torch optimizer``), ``batches``,
and optionally ``seed`` (0), ``accum`` (1), ``max_grad_norm``, ``find_unused`` (False: every
parameter gets a gradient every step). DDP steps zeroray's optimizer, not the single-process
reference's: ``zr.AdamW`` builds torch's fused AdamW, which rounds differently from the default
kernel, so DDP then differs from zeroray only in how the ranks' gradients are summed.
"""
import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zeroray.engine.batch import split_batch


def train_ddp(rank: int, world: int, port: int, spec: dict, kept: list) -> dict:
    """Train ``spec`` as rank ``rank`` of ``world``; returns ``{"losses", "norms", "state"}``
    (this rank's mean loss per step, the global norm, the state dict after the last step).
    The DDP module goes into ``kept``: it lives until the rank exits (harness._run_rank says why)."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(spec.get("seed", 0))
        model = spec["model_fn"]()
        ddp = DistributedDataParallel(model, find_unused_parameters=spec.get("find_unused", False))
        kept.append(ddp)
        params = [p for p in model.parameters() if p.requires_grad]
        spec_opt = spec["optimizer"]
        opt = spec_opt.build(params) if hasattr(spec_opt, "build") else spec_opt(params)
        accum, loss_fn = spec.get("accum", 1), spec["loss_fn"]
        max_norm = spec.get("max_grad_norm") or float("inf")
        losses, norms = [], []
        for batch in spec["batches"]:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m, mb in enumerate(split_batch(split_batch(batch, world)[rank], accum)):
                with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                    loss = loss_fn(ddp, mb)
                    (loss / accum).backward()
                total += loss.item() / accum
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
            opt.step()
            losses.append(total)
        return {"losses": losses, "norms": norms,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    finally:
        dist.destroy_process_group()
