"""Buffers follow torch DDP's default, ``broadcast_buffers=True`` ([Note: buffers follow DDP] in
zeroray/engine/buffer_sync.py), shown against torch DDP over gloo.

First what DDP does, observed with a forward pre-hook on a BatchNorm (the buffers a forward
starts from): at the first forward of each step every rank holds rank 0's buffers; with
gradient accumulation (``no_sync`` on all but the last micro-batch) only the first micro-batch
starts from them; an evaluation forward (eval mode, ``no_grad``) after a step starts from
rank 0's too, and the forward after one without gradients does not broadcast.

Then zeroray against DDP: a BatchNorm model (plain, not synchronised; each worker's statistics
come from its own rows) at stages 0-3 on 2 workers, with evaluations between steps: each rank's
per-step loss and buffers, the parameters and each rank's evaluation equal DDP's; gradient
accumulation; and ``broadcast_buffers=False`` equals DDP's ``broadcast_buffers=False``, each
worker keeping its own.
"""
import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zeroray as zr
from tests.batchnorm_models import class_loss, conv_bn, feature_batches, image_batches, mlp_bn
from tests.dist.harness import gloo_world, load_ranks, spawn_ranks
from zeroray.comm.group import make_torch_group
from zeroray.comm.port import free_port, free_ports
from zeroray.comm.user_group import join_default_group, leave_default_group
from zeroray.engine.batch import split_batch
from zeroray.engine.engine import Engine

WORLD = 2
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TRAIN_BEFORE, TRAIN_AFTER = 3, 2  # steps, then an evaluation, then more steps and another
MODELS = {"conv": (conv_bn, image_batches), "mlp": (mlp_bn, feature_batches)}
# (model, stage, grad_accum_steps, broadcast_buffers)
CASES = ([("conv", s, 1, True) for s in range(4)] + [("mlp", s, 1, True) for s in (0, 3)]
         + [("conv", 1, 2, True), ("mlp", 3, 2, True), ("conv", 0, 1, False), ("conv", 3, 1, False),
            ("mlp", 2, 2, False)])


def _data(model):
    make = MODELS[model][1]
    return make(TRAIN_BEFORE + TRAIN_AFTER, seed=3), make(2, seed=4)


def _buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


# --- what DDP does -------------------------------------------------------------------------------

def _ddp_facts_rank(rank, world, port, out_dir):
    gloo_world(rank, world, port)
    torch.manual_seed(0)
    model = conv_bn()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    bn = model.features[1]
    starts = []  # the running mean each forward of this BatchNorm starts from
    bn.register_forward_pre_hook(lambda m, args: starts.append(m.running_mean.detach().clone()))
    log = {"ends": []}  # this rank's running mean after each step / call
    batches, evals = _data("conv")
    for step, batch in enumerate(batches[:3]):
        opt.zero_grad()
        micro = split_batch(split_batch(batch, world)[rank], 2)
        for m, mb in enumerate(micro):
            with ddp.no_sync() if m == 0 else contextlib.nullcontext():
                (class_loss(ddp, mb) / 2).backward()
        opt.step()
        log["ends"].append(bn.running_mean.detach().clone())
    ddp.eval()
    with torch.no_grad():
        for batch in evals:
            class_loss(ddp, split_batch(batch, world)[rank])
    ddp.train()
    with torch.no_grad():
        bn.running_mean.add_(float(rank + 1))  # an evaluation that changed the buffers
    log["changed"] = bn.running_mean.detach().clone()
    opt.zero_grad()
    class_loss(ddp, split_batch(batches[3], world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    class_loss(ddp, split_batch(batches[4], world)[rank]).backward()
    log["starts"] = starts
    torch.save(log, os.path.join(out_dir, f"facts_rank{rank}.pt"))
    dist.destroy_process_group()


def test_what_torch_ddp_does_with_buffers():
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_ddp_facts_rank, WORLD, (WORLD, free_port()), out_dir, join_s=120)
        ranks = load_ranks(out_dir, "facts", WORLD)
    zero, one = ranks
    # Forwards: 3 steps x 2 micro-batches, 2 evaluation batches, 2 more training forwards.
    assert len(one["starts"]) == 3 * 2 + 2 + 2
    for step in range(3):
        first, second = one["starts"][2 * step], one["starts"][2 * step + 1]
        before = zero["ends"][step - 1] if step else torch.zeros_like(first)  # rank 0's, at the step's start
        assert torch.equal(first, before), f"step {step}: the first micro-batch starts from rank 0's buffers"
        assert not torch.equal(second, zero["starts"][2 * step + 1]), \
            f"step {step}: the second micro-batch starts from this rank's own (no broadcast under no_sync)"
        assert not torch.equal(one["ends"][step], zero["ends"][step])  # each rank's rows moved its own
    eval_first, eval_second = one["starts"][6], one["starts"][7]
    assert torch.equal(eval_first, zero["ends"][2]), "an evaluation after a step starts from rank 0's buffers"
    assert torch.equal(eval_second, eval_first)
    # The forward after a no_grad one does not broadcast: rank 1 trains from its own changed buffers...
    assert torch.equal(one["starts"][8], one["changed"]) and not torch.equal(one["changed"], zero["changed"])
    # ... and the one after that (a forward that synchronised gradients came before) does.
    assert torch.equal(one["starts"][9], zero["starts"][9])


# --- zeroray against DDP -------------------------------------------------------------------------

def _train_and_evaluate(step, evaluate, batches, evals, rank):
    """The schedule both sides follow: this rank's loss per step, and per evaluation its loss on
    each eval batch."""
    losses, evaluations = [], []
    for i, batch in enumerate(batches):
        losses.append(step(split_batch(batch, WORLD)[rank]))
        if i + 1 in (TRAIN_BEFORE, TRAIN_BEFORE + TRAIN_AFTER):
            evaluations.append([evaluate(split_batch(b, WORLD)[rank]) for b in evals])
    return losses, evaluations


def _ddp_rank(rank, world, ports, out_dir):
    kept = []  # every case's DDP lives until the rank exits (harness._run_rank says why)
    for index, ((name, _, accum, broadcast), port) in enumerate(zip(CASES, ports)):
        gloo_world(rank, world, port)
        torch.manual_seed(0)
        model = MODELS[name][0]()
        # broadcast_buffers, named forward_sync_buffers in torch 2.13 (the buffers are equal at init)
        ddp = DistributedDataParallel(model, forward_sync_buffers=broadcast)
        kept.append(ddp)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        per_step = []

        def step(rows):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m, mb in enumerate(split_batch(rows, accum)):
                with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                    loss = class_loss(ddp, mb)
                    (loss / accum).backward()
                total += loss.item() / accum
            opt.step()
            per_step.append(_buffers(model))
            return total

        def evaluate(rows):
            ddp.eval()
            with torch.no_grad():
                value = class_loss(ddp, rows).item()
            ddp.train()
            return value
        batches, evals = _data(name)
        losses, evaluations = _train_and_evaluate(step, evaluate, batches, evals, rank)
        torch.save({"losses": losses, "buffers": per_step, "evals": evaluations,
                    "params": {k: v.detach().clone() for k, v in model.named_parameters()}},
                   os.path.join(out_dir, f"ddp{index}_rank{rank}.pt"))
        dist.destroy_process_group()


def _zeroray_rank(rank, world, ports, out_dir):
    torch.set_num_threads(1)
    kept = []
    for index, ((name, stage, accum, broadcast), port) in enumerate(zip(CASES, ports)):
        group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=120)
        join_default_group(group, "gloo", 120)
        zero = zr.ZeroConfig(stage=stage, grad_accum_steps=accum, broadcast_buffers=broadcast)
        engine = Engine(MODELS[name][0], class_loss, zr.AdamW(**ADAMW), zero, group)
        per_step = []

        def step(rows):
            loss = engine.train_step(rows).loss
            per_step.append(_buffers(engine.model))
            return loss
        batches, evals = _data(name)
        losses, evaluations = _train_and_evaluate(step, lambda rows: engine.evaluate(rows)["loss"], batches,
                                                  evals, rank)
        pieces = {n: engine.master_piece(n) for n in engine.layout.param_names}
        torch.save({"losses": losses, "buffers": per_step, "evals": evaluations, "pieces": pieces,
                    "broadcasts": engine.group.counter.collectives.get("broadcast")},
                   os.path.join(out_dir, f"zr{index}_rank{rank}.pt"))
        engine.close()
        kept.append(leave_default_group())
        group.close()


@pytest.fixture(scope="module")
def runs():
    """Per case: (zeroray's ranks, DDP's ranks)."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_ddp_rank, WORLD, (WORLD, free_ports(len(CASES))), out_dir, join_s=300)
        spawn_ranks(_zeroray_rank, WORLD, (WORLD, free_ports(len(CASES))), out_dir, join_s=600)
        return [(load_ranks(out_dir, f"zr{i}", WORLD), load_ranks(out_dir, f"ddp{i}", WORLD)) for i in range(len(CASES))]


def _full(pieces_per_rank, name):
    numel = max(p[name][1] for p in pieces_per_rank)
    flat = torch.zeros(numel)
    for pieces in pieces_per_rank:
        lo, hi, t = pieces[name]
        flat[lo:hi] = t
    return flat


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{m}-stage{s}-accum{k}-{'bcast' if b else 'own'}"
                                                          for m, s, k, b in CASES])
def test_equals_torch_ddp(runs, case):
    """Each rank's losses and buffers after every step, the parameters, and each rank's
    evaluations equal torch DDP's with the same broadcast_buffers."""
    name, stage, accum, broadcast = CASES[case]
    ours, ddp = runs[case]
    worst = {"loss": 0.0, "params": 0.0, "buffers": 0.0, "eval": 0.0}
    for r in range(WORLD):
        for i, (a, b) in enumerate(zip(ours[r]["losses"], ddp[r]["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {r}, step {i}: loss {a} vs DDP {b}"
            worst["loss"] = max(worst["loss"], abs(a - b) / abs(b))
        for i, (got, want) in enumerate(zip(ours[r]["buffers"], ddp[r]["buffers"])):
            for key, value in want.items():
                err = (got[key].double() - value.double()).abs().max().item()
                assert err <= 1e-5, f"rank {r}, step {i}: {key} vs DDP's rank {r}: {err:.2e}"
                worst["buffers"] = max(worst["buffers"], err)
        for got, want in zip(ours[r]["evals"], ddp[r]["evals"]):
            for a, b in zip(got, want):
                assert abs(a - b) <= 1e-5 * abs(b), f"rank {r}: evaluation {a} vs DDP {b}"
                worst["eval"] = max(worst["eval"], abs(a - b) / abs(b))
    for key, want in ddp[0]["params"].items():
        err = (_full([o["pieces"] for o in ours], key).view(want.shape) - want).abs().max().item()
        assert err <= 1e-5, f"{key}: {err:.2e} from DDP"
        worst["params"] = max(worst["params"], err)
    # The ranks' own statistics differ after a step (their rows differ): the rule is what decides
    # which one each rank evaluates with.
    last = [o["buffers"][-1] for o in ours]
    assert any(not torch.equal(last[0][k], last[1][k]) for k in last[0] if "running" in k)
    evals_equal = ours[0]["evals"] == ours[1]["evals"]
    assert not evals_equal  # each rank evaluates its own rows
    calls = ours[0]["broadcasts"]
    if broadcast:  # one coalesced broadcast per call: since the counter's reset, the last step and two evaluate calls
        assert calls is not None and calls.calls == 3 and calls.payload_bytes > 0, calls
    else:
        assert calls is None
    print(f"{name}, stage {stage}, accum {accum}, broadcast_buffers={broadcast}: vs torch DDP loss rel "
          f"{worst['loss']:.1e}, params {worst['params']:.1e}, buffers (each rank, each step) {worst['buffers']:.1e}, "
          f"evaluate rel {worst['eval']:.1e}")


def test_broadcast_makes_each_rank_evaluate_with_rank_0s_statistics(runs):
    """The same schedule with and without the broadcast gives other evaluations on rank 1 (its
    own statistics against rank 0's) and the same on rank 0, whose buffers no broadcast moves."""
    by_case = {c: r for c, r in zip(CASES, runs)}
    shared, own = by_case[("conv", 0, 1, True)][0], by_case[("conv", 0, 1, False)][0]
    assert shared[0]["evals"] == own[0]["evals"]
    assert all(abs(a - b) > 1e-6 for a, b in zip(shared[1]["evals"][0], own[1]["evals"][0]))
