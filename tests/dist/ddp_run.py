"""torch DDP (gloo) training of a harness spec, on one rank: the parity tests' second reference.

``ddp_spec(...)`` is a harness spec (its ``runner``, tests/dist/harness.py) that trains
``model_fn`` under ``DistributedDataParallel`` in the engine runs' processes, on the same global
batches as zeroray's runs: each rank's loss is ``loss_fn`` on its equal share of the rows, DDP
averages the gradients over the ranks. Its distance
from single-process PyTorch is what float reordering alone moves a run by: [Note: parity bound]
in tests/dist/parity.py.

Spec keys: ``model_fn``, ``loss_fn``, ``optimizer`` (``params -> torch optimizer``), ``batches``,
and optionally ``seed`` (0). The run uses no zeroray code: a bug there (an optimizer
spec that builds the wrong optimizer, a batch split that drops rows) would move DDP as far as
zeroray and widen the bound with it, so the optimizer is a torch one the test builds and the
rows are split here. The tests give it the kernel zeroray's ``zr.AdamW`` builds (torch's fused
AdamW, which rounds differently from the single-process reference's default kernel), so DDP
differs from zeroray only in how the ranks' gradients are summed.
"""
import datetime
import functools
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _rows(batch, parts: int, index: int):
    """Piece ``index`` of ``parts`` equal pieces of a tensor / tuple / list / dict batch, along dim 0."""
    if isinstance(batch, torch.Tensor):
        assert batch.shape[0] % parts == 0, f"{batch.shape[0]} rows do not split into {parts}"
        n = batch.shape[0] // parts
        return batch[index * n:(index + 1) * n]
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
        return {k: _rows(v, parts, index) for k, v in batch.items()}
    return type(batch)(_rows(v, parts, index) for v in batch)


def fused_adamw(**hyper):
    """``params -> torch.optim.AdamW(params, fused=True, **hyper)``: the kernel ``zr.AdamW(**hyper)``
    builds, as a DDP spec's ``optimizer``."""
    return functools.partial(torch.optim.AdamW, fused=True, **hyper)


def ddp_spec(**spec) -> dict:
    """A harness spec (``run_engines``, beside engine specs) training ``spec`` under torch DDP; its
    result is ``(rank results, None)``, each rank's ``{"losses", "norms", "state"}``."""
    return {"runner": train_ddp, **spec}


def train_ddp(rank: int, world: int, port: int, spec: dict) -> dict:
    """Train ``spec`` as rank ``rank`` of ``world``; returns ``{"losses", "norms", "state"}``
    (this rank's mean loss per step, the global norm, the state dict after the last step).
    The DDP module stays referenced from ``spec``, which the harness holds until the rank exits:
    a gloo group dropped at the wrong time can deadlock (harness._run_rank says why)."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(spec.get("seed", 0))
        model = spec["model_fn"]()
        ddp = DistributedDataParallel(model)
        spec.setdefault("kept", []).append(ddp)
        params = [p for p in model.parameters() if p.requires_grad]
        assert not hasattr(spec["optimizer"], "build"), "a DDP reference takes a torch optimizer, not zeroray's spec"
        opt = spec["optimizer"](params)
        losses, norms = [], []
        for batch in spec["batches"]:
            opt.zero_grad(set_to_none=True)
            loss = spec["loss_fn"](ddp, _rows(batch, world, rank))
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "norms": norms,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    finally:
        dist.destroy_process_group()
