"""torch DDP (gloo) training of a harness spec, on one rank: the parity tests' second reference.

``ddp_spec(...)`` is a harness spec (its ``runner``, tests/dist/harness.py) that trains
``model_fn`` under ``DistributedDataParallel`` in the engine runs' processes, on the same global
batches as zeroray's runs: each rank's loss is ``loss_fn`` on its share of the rows, DDP
averages the gradients over the ranks. Its distance
from single-process PyTorch is what float reordering alone moves a run by: [Note: parity bound]
in tests/dist/parity.py.

Rows that do not divide are split as zeroray's [Note: uneven splits] says, written here from
its rule: ``torch.tensor_split`` (``numpy.array_split``'s cut: the first ``N % W`` ranks get a
row more), then each rank's share over ``accum`` micro-batches the same way, and a part of
``n_p`` rows has its loss scaled by ``n_p * W * k / N`` (k = ``accum``) and divided by k before
backward, so the gradient DDP averages is ``sum_p n_p / N * grad L_p``. A weight of exactly 1
(every equal split) is left out, so an equal split's run is the plain DDP recipe, bit for bit.
The micro-batches but the last run under ``no_sync``, as DDP's gradient accumulation does.

Spec keys: ``model_fn``, ``loss_fn``, ``optimizer`` (``params -> torch optimizer``), ``batches``,
and optionally ``accum`` (micro-batches per rank, 1) and ``seed`` (0). The run uses no zeroray
code: a bug there (an optimizer spec that builds the wrong optimizer, a batch split that drops
rows or weighs them wrongly) would move DDP as far as zeroray and widen the bound with it, so
the optimizer is a torch one the test builds and the rows are split and weighted here. The
tests give it the kernel zeroray's ``zr.AdamW`` builds (torch's fused AdamW, which rounds
differently from the single-process reference's default kernel), so DDP differs from zeroray
only in how the ranks' gradients are summed (and, with uneven parts, where each part's weight
falls).
"""
import contextlib
import datetime
import functools
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _rows(batch, parts: int, index: int):
    """Piece ``index`` of a tensor / tuple / list / dict batch cut into ``parts`` along dim 0 as
    ``numpy.array_split`` cuts (every piece needs a row)."""
    if isinstance(batch, torch.Tensor):
        assert batch.shape[0] >= parts, f"{batch.shape[0]} rows do not split into {parts} non-empty parts"
        return torch.tensor_split(batch, parts)[index]
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
        return {k: _rows(v, parts, index) for k, v in batch.items()}
    return type(batch)(_rows(v, parts, index) for v in batch)


def _num_rows(batch) -> int:
    """dim 0 of a batch's first tensor (every tensor of it has the same)."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values() if isinstance(batch, Mapping) else batch))
    return batch.shape[0]


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
    (this rank's weighted loss per step, whose mean over the ranks is the global batch's, the
    global norm, the state dict after the last step).
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
        k = spec.get("accum", 1)
        losses, norms = [], []
        for batch in spec["batches"]:
            opt.zero_grad(set_to_none=True)
            share = _rows(batch, world, rank)
            loss_sum = 0.0
            for i in range(k):
                micro = _rows(share, k, i)
                weight = _num_rows(micro) * world * k / _num_rows(batch)
                # the gradients are all-reduced on the last micro-batch's backward only
                with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                    loss = spec["loss_fn"](ddp, micro)
                    if weight != 1.0:
                        loss = loss * weight
                    if k > 1:
                        loss = loss / k
                    loss.backward()
                loss_sum += loss.item()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
            opt.step()
            losses.append(loss_sum)
        return {"losses": losses, "norms": norms,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    finally:
        dist.destroy_process_group()
