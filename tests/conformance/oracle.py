"""The oracle: the case trained by plain single-process PyTorch, in fp32, with DDP's semantics.

Same initial weights (``torch.manual_seed(seed); FuzzNet(spec)``), same global batches,
the same optimizer (recipe.py) over the named trainable parameters (and parameter groups and
warm-up scheduler where the case has them). The global batch is cut as zeroray cuts
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

SyncBatchNorm (``spec.sync_bn``) on several workers: micro-batch ``m`` of every worker goes
through the model in one forward (single-process BatchNorm over all those rows, which is what
SyncBatchNorm computes across workers, as under torch DDP), each worker's loss is taken from its
own rows' logits, and the running statistics (the same on every worker) move once per micro-batch.

``reorder_spread`` runs the oracle again with its gradients summed in other orders, for the
optimizers judged by that spread (recipe.REORDER_BOUND, compare.py).

Evaluation (``case.evaluate``): after training, each worker's share of the eval batch goes
through ``loss_fn`` and ``fuzz_logits`` in eval mode under ``torch.no_grad()``, with worker 0's
buffers (DDP broadcasts them before an evaluation forward that follows a step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from tests.conformance.case import Case
from tests.conformance.configs import warmup
from tests.conformance.grammar import fuzz_logits, loss_of_logits
from tests.conformance.recipe import oracle_optimizer
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


def reference_run(case: Case, reorder: Tuple[bool, bool, bool] = (False, False, False)) -> Reference:
    """The oracle's run. ``reorder`` = (reversed, unscaled, norm_in_fp64) sums the same gradients
    in another order: the workers' parts in reverse order, and/or each part's loss backpropagated
    unscaled with the gradients scaled after the step's backward, and/or the clipping norm summed in
    float64 over the parameters in reverse order instead of by ``clip_grad_norm_`` (zeroray sums
    it in another order by design, ``squared_norm``; at one part per step the other two orders
    change nothing, and torch's bf16 Muon turns a one-ulp difference of the clip coefficient
    into 1e-3 in its weight: fuzz seed 1796326114) (``reorder_spread``)."""
    config = case.config
    world, accum = config.world, config.accum
    torch.manual_seed(case.seed)
    model = case.model_fn()()
    loss_fn = case.loss_fn()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = [{"params": [(n, p)], **config.group_overrides(n, p)} for n, p in named] if config.groups else named
    opt = oracle_optimizer(config.optimizer, groups, config.adamw)
    scheduler = warmup(opt) if config.scheduler else None
    buffers = [_buffers(model) for _ in range(world)]
    out = Reference([], [], {}, [], [n for n, _ in model.named_parameters(remove_duplicate=False)])
    ranks = list(range(world))[::-1] if reorder[0] else list(range(world))
    nparts = world * accum
    for batch in case.batches:
        opt.zero_grad(set_to_none=True)
        parts = [mb for share in split_batch(batch, world) for mb in split_batch(share, accum)]
        rows = batch_size(batch)
        even = rows % nparts == 0
        unscaled = reorder[1] and even  # backpropagate each loss as it is, divide the gradients after

        def backward(terms):  # [(loss, its part)] of one forward; returns their term of the total, times nparts
            if even:
                sum(loss if unscaled else loss / nparts for loss, _ in terms).backward()
                return sum(loss.item() for loss, _ in terms)
            shares = [batch_size(part) / rows for _, part in terms]  # weighted by rows; the total stays "times nparts"
            sum(loss * share for (loss, _), share in zip(terms, shares)).backward()
            return sum(loss.item() * share * nparts for (loss, _), share in zip(terms, shares))

        buffers = [buffers[0]] * world  # rank 0's at the start of the step
        if case.model.sync_bn and world > 1:
            total = _sync_step(case, model, parts, ranks, backward)
            buffers = [_buffers(model)] * world
        else:
            total = 0.0
            for rank in ranks:
                _load_buffers(model, buffers[rank])
                for micro in range(accum):
                    part = parts[rank * accum + micro]
                    total += backward([(loss_fn(model, part), part)])
                buffers[rank] = _buffers(model)
        if unscaled:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(nparts)
        _load_buffers(model, buffers[0])
        out.unused.append([n for n, p in named if p.grad is None])
        max_norm = config.zero.get("max_grad_norm") or float("inf")
        out.norms.append(_clip_in_fp64(params, max_norm) if reorder[2]
                         else float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        out.losses.append(total / nparts)
    out.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if case.evaluate:
        _evaluate(case, model, buffers, out)
    return out


def _sync_step(case: Case, model: torch.nn.Module, parts: List[dict], ranks: List[int], backward) -> float:
    """One step of a SyncBatchNorm model on several workers: micro-batch ``m`` of every worker in
    one forward (BatchNorm over all their rows, what SyncBatchNorm computes across the workers),
    then each worker's loss from its own rows' logits; ``backward(terms)`` as in
    ``reference_run``, once, of the workers' losses together. Returns the step's total, as
    ``reference_run`` sums it."""
    world, accum = case.config.world, case.config.accum
    total = 0.0
    for micro in range(accum):
        mine = [parts[rank * accum + micro] for rank in range(world)]
        both = {k: torch.cat([p[k] for p in mine]) for k in mine[0]}
        logits = fuzz_logits(case.model, model, both)
        starts = [0]
        for p in mine:
            starts.append(starts[-1] + batch_size(p))
        terms = [(loss_of_logits(case.model, model, logits[starts[r]:starts[r + 1]], mine[r]), mine[r]) for r in ranks]
        total += backward(terms)
    return total


def reorder_spread(case: Case, ref: Reference) -> Dict[str, float]:
    """How far the oracle moves from ``ref`` when only its gradients' summation order changes
    (``reference_run``'s three other orders): the largest relative loss and gradient-norm and
    eval-loss differences, the largest absolute state and eval-output differences."""
    spread = {"loss": 0.0, "norm": 0.0, "state": 0.0, "eval_loss": 0.0, "eval_output": 0.0}
    for reorder in ((True, False, False), (False, True, False), (True, True, False), (False, False, True)):
        other = reference_run(case, reorder)
        spread["loss"] = max([spread["loss"]] + [_rel(a, b) for a, b in zip(other.losses, ref.losses)])
        spread["norm"] = max([spread["norm"]] + [_rel(a, b) for a, b in zip(other.norms, ref.norms)])
        spread["state"] = max([spread["state"]] + [(other.state[k].double() - v.double()).abs().max().item()
                                                   for k, v in ref.state.items() if v.is_floating_point()])
        if ref.eval_losses:
            spread["eval_loss"] = max(spread["eval_loss"], _rel(sum(other.eval_losses), sum(ref.eval_losses)))
            spread["eval_output"] = max([spread["eval_output"]] + [(a - b).abs().max().item() for a, b in
                                                                   zip(other.eval_outputs, ref.eval_outputs)])
    return spread


def _clip_in_fp64(params: List[torch.Tensor], max_norm: float) -> float:
    """``clip_grad_norm_``'s rule with the norm summed in another order: float64, the parameters
    reversed. Returns the norm before clipping, as ``clip_grad_norm_`` does."""
    grads = [p.grad for p in reversed(params) if p.grad is not None]
    norm = float(torch.tensor(float(sum(g.double().pow(2).sum() for g in grads) ** 0.5) if grads else 0.0,
                              dtype=torch.float32))  # rounded to fp32, as clip_grad_norm_'s
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


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
