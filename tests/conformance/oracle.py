"""The oracle: the case trained by plain single-process PyTorch, in fp32, with DDP's semantics.

Same initial weights (``torch.manual_seed(seed); FuzzNet(spec)``), same global batches,
``torch.optim.AdamW`` with the same hyperparameters (and parameter groups and warm-up scheduler
where the case has them). The global batch is cut as zeroray cuts
it (workers, then micro-batches: part ``rank * accum + micro``) and the step's loss is the
mean over the parts of ``loss_fn`` on each part: DDP's loss (each worker's mean over its own
rows, averaged over workers), which is the global loss only for equal-size mean losses; with
padding, a BatchNorm or data-dependent routing it is not, and the part's is what counts. A
global batch that does not divide over the parts (case ``uneven``) is cut as ``numpy.array_split``
cuts, workers first, and the mean is weighted by the parts' rows, ``sum_p n_p / N * loss_p``
([Note: uneven splits] in zeroray/engine/batch.py).
Gradients are those of that mean; a parameter no part used keeps ``.grad = None`` and
AdamW skips it (PyTorch's and DDP's rule). Clipping by the global norm of all gradients.

Buffers are per worker within a step: each worker's forward updates its own (BatchNorm
running statistics), so the oracle keeps one buffer state per worker, runs each worker's parts
with that worker's state, and reports worker 0's. Every worker starts each step from worker 0's
buffers, as under DDP's default ``broadcast_buffers`` and zeroray's (tests/dist/test_buffer_broadcast.py).

Evaluation (``case.evaluate``): after training, each worker's share of the eval batch goes
through ``loss_fn`` and ``fuzz_logits`` in eval mode under ``torch.no_grad()``, with worker 0's
buffers (DDP broadcasts them before an evaluation forward that follows a step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from tests.conformance.case import Case
from tests.conformance.configs import warmup
from zeroray.engine.batch import batch_size, split_batch


@dataclass
class Reference:
    losses: List[float]
    norms: List[float]                 # the global gradient norm before clipping
    state: Dict[str, torch.Tensor]     # state_dict after the last step (worker 0's buffers)
    unused: List[List[str]]            # per step, trainable parameters no part used
    param_names: List[str]             # every parameter's state_dict name (tied, frozen included)
    eval_losses: List[float] = field(default_factory=list)         # per worker, after training
    eval_outputs: List[torch.Tensor] = field(default_factory=list)  # per worker: its rows' logits


def reference_run(case: Case) -> Reference:
    config = case.config
    world, accum = config.world, config.accum
    torch.manual_seed(case.seed)
    model = case.model_fn()()
    loss_fn = case.loss_fn()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = [{"params": [p], **config.group_overrides(n, p)} for n, p in named] if config.groups else params
    opt = torch.optim.AdamW(groups, **config.adamw)
    scheduler = warmup(opt) if config.scheduler else None
    buffers = [_buffers(model) for _ in range(world)]
    out = Reference([], [], {}, [], [n for n, _ in model.named_parameters(remove_duplicate=False)])
    for batch in case.batches:
        opt.zero_grad(set_to_none=True)
        parts = [mb for share in split_batch(batch, world) for mb in split_batch(share, accum)]
        rows = batch_size(batch)
        even = rows % (world * accum) == 0
        total = 0.0
        buffers = [buffers[0]] * world  # rank 0's at the start of the step
        for rank in range(world):
            _load_buffers(model, buffers[rank])
            for micro in range(accum):
                part = parts[rank * accum + micro]
                loss = loss_fn(model, part)
                if even:
                    (loss / (world * accum)).backward()
                    total += loss.item()
                else:  # weighted by its rows; total stays "times world * accum"
                    share = batch_size(part) / rows
                    (loss * share).backward()
                    total += loss.item() * share * world * accum
            buffers[rank] = _buffers(model)
        _load_buffers(model, buffers[0])
        out.unused.append([n for n, p in named if p.grad is None])
        max_norm = config.zero.get("max_grad_norm") or float("inf")
        out.norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        out.losses.append(total / (world * accum))
    out.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if case.evaluate:
        _evaluate(case, model, buffers, out)
    return out


def _evaluate(case: Case, model: torch.nn.Module, buffers: List[Dict[str, torch.Tensor]], out: Reference) -> None:
    """Each worker's share of the eval batch, in eval mode without gradients, with worker 0's buffers."""
    world = case.config.world
    loss_fn, logits_fn = case.loss_fn(), case.logits_fn()
    model.eval()
    with torch.no_grad():
        for share in split_batch(case.eval_batch, world):
            _load_buffers(model, buffers[0])
            out.eval_losses.append(loss_fn(model, share).item())
            out.eval_outputs.append(logits_fn(model, share).detach().clone())
    model.train()


def _buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _load_buffers(model: torch.nn.Module, values: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(values[k])
