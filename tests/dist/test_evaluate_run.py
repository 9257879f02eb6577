"""Evaluation and inference on the sharded model, engine level (issue 24; [Note: inference calls]).

``Engine.evaluate`` on a model with dropout and BatchNorm (where eval mode changes the result)
at stages 0-3 on 2 workers must equal single-process PyTorch evaluation on the same weights
(``model.eval()``, ``torch.no_grad()``; each worker's rows with rank 0's BatchNorm statistics,
which every worker holds at the start of the call, as under torch DDP's default
``broadcast_buffers``: tests/dist/test_buffer_broadcast.py), and must leave
training exactly as it was: the same random state, no gradient, the same step count, the model
back in train mode, and the next steps equal (bitwise) to a run without the evaluation, stage 3's
following the same trace (no negotiated rounds). ``Engine.run`` at stage 3: workers whose ``fn``
stops at different points (Hugging Face ``generate`` with a different ``max_new_tokens`` per
rank, one rank raising after one forward) never hang, and the group trains on afterwards.
"""
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroray as zr
from tests.dist.harness import record_failure, spawn_ranks
from tests.real_models import hf_gpt2, real_batches, real_loss
from zeroray.engine.batch import split_batch
from zeroray.comm.group import make_torch_group
from zeroray.comm.port import free_ports
from zeroray.engine.engine import Engine
from zeroray.errors import PeerStepError

WORLD = 2
FEATURES, CLASSES = 6, 5


class DropBN(nn.Module):
    """Dropout and BatchNorm: eval mode changes both (no dropout, running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(F.relu(self.bn(self.fc(x)))))


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


SEEN = []  # per process: (rank, world size) that zeroray.worker_context() gave loss_fn in steps and evaluations


def ce_loss_seeing_context(model, batch):
    context = zr.worker_context()
    SEEN.append((context.rank, context.world_size))
    return ce_loss(model, batch)


def accuracy(model, batch):
    x, y = batch
    logits = model(x)
    return {"acc": (logits.argmax(-1) == y).float().mean(), "max_logit": float(logits.max())}


def classification_batches(n, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, FEATURES, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))
            for _ in range(n)]


TRAIN, EVAL = classification_batches(4), classification_batches(3, seed=1)


def _engine(rank, port, model_fn, loss_fn, stage):
    group = make_torch_group("gloo", rank, WORLD, "127.0.0.1", port, timeout_s=60)
    return Engine(model_fn, loss_fn, zr.AdamW(lr=1e-2), zr.ZeroConfig(stage=stage), group), group


def _train(engine, rank, batches):
    losses, fetch = [], []
    for batch in batches:
        losses.append(engine.train_step(split_batch(batch, WORLD)[rank]).loss)
        fetch.append(engine.fetch_stats())
    return losses, fetch


def _evaluate_case(rank, port, stage, with_eval):
    """Two steps, the evaluation (or not), two more steps."""
    engine, group = _engine(rank, port, DropBN, ce_loss_seeing_context, stage)
    SEEN.clear()
    out = {}
    losses, fetch = _train(engine, rank, TRAIN[:2])
    if with_eval:
        names = engine.layout.param_names
        out["weights"] = {n: engine.master_piece(n) for n in names}
        out["buffers"] = engine.untrained_state()
        rng = torch.get_rng_state()
        out["evals"] = [engine.evaluate(split_batch(b, WORLD)[rank], accuracy) for b in EVAL]
        out["rng_unchanged"] = torch.equal(rng, torch.get_rng_state())
        out["no_grads"] = all(p.grad is None for p in engine.model.parameters())
        out["training_after"] = engine.model.training
        out["step_count"] = engine.step_count
        out["buffers_after"] = engine.untrained_state()
    more, more_fetch = _train(engine, rank, TRAIN[2:])
    out["losses"], out["fetch"] = losses + more, fetch + more_fetch
    out["final"] = {n: engine.master_piece(n) for n in engine.layout.param_names}
    out["seen"] = sorted(set(SEEN))
    engine.close()
    group.close()
    return out


def _generate(model, ids):
    rank = zr.worker_context().rank
    return model.generate(ids, max_new_tokens=3 + 4 * rank, do_sample=False, pad_token_id=0)


def _raise_on_rank1(model, ids):
    if zr.worker_context().rank == 1:
        model(ids)
        raise KeyError("rank 1's fn failed after one forward")
    return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


def _run_case(rank, port, with_run):
    """Stage 3 GPT-2: generate to different lengths per rank; an error on one rank; training after
    (or the same training without the run calls)."""
    engine, group = _engine(rank, port, hf_gpt2, real_loss, 3)
    steps = real_batches(3, batch=4)
    _train(engine, rank, steps[:1])
    ids = torch.tensor([[5, 9, 2]])
    out = {}
    if with_run:
        out["tokens"] = engine.run(_generate, ids)
        try:
            engine.run(_raise_on_rank1, ids)
            out["error"] = None
        except (KeyError, PeerStepError) as error:
            out["error"] = type(error).__name__
        out["context_outside"] = _context_outside()
    out["losses"], out["fetch"] = _train(engine, rank, steps[1:])
    out["state"] = {n: engine.master_piece(n) for n in engine.layout.param_names}
    engine.close()
    group.close()
    return out


def _context_outside():
    try:
        zr.worker_context()
    except RuntimeError:
        return "raises"
    return "returned"


CASES = [("eval", s, True) for s in range(4)] + [("noeval", s, False) for s in range(4)] + \
    [("run", 3, True), ("norun", 3, False)]


def _worker(rank, world, ports, out_dir):
    torch.set_num_threads(1)
    try:
        for (name, stage, with_eval), port in zip(CASES, ports):  # with_eval: with the evaluate/run calls
            if name.endswith("run"):
                out = _run_case(rank, port, with_eval)
            else:
                out = _evaluate_case(rank, port, stage, with_eval)
            torch.save(out, os.path.join(out_dir, f"{name}{stage}_rank{rank}.pt"))
    except BaseException:
        record_failure(rank, out_dir)
        raise


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_worker, WORLD, (WORLD, free_ports(len(CASES))), out_dir, join_s=300)
        return {f"{name}{stage}": [torch.load(os.path.join(out_dir, f"{name}{stage}_rank{r}.pt"), weights_only=False)
                                   for r in range(WORLD)] for name, stage, _ in CASES}


def _full(pieces_per_rank, model):
    """The consolidated fp32 parameters, as a state dict of ``model``."""
    state = {}
    for name, p in model.named_parameters():
        flat = torch.zeros(p.numel())
        for pieces in pieces_per_rank:
            lo, hi, t = pieces[name]
            flat[lo:hi] = t
        state[name] = flat.view(p.shape)
    return state


def _reference_eval(weights, buffers, rank, train_mode=False):
    """Single-process evaluation of worker ``rank``'s rows, on its weights and BatchNorm statistics."""
    model = DropBN()
    model.load_state_dict({**_full(weights, model), **buffers})
    model.train(train_mode)
    torch.manual_seed(0)  # train mode draws dropout masks: the same ones whatever ran in this process before
    with torch.no_grad():
        return [{"loss": ce_loss(model, split_batch(b, WORLD)[rank]).item(),
                 **{k: float(v) for k, v in accuracy(model, split_batch(b, WORLD)[rank]).items()}} for b in EVAL]


@pytest.mark.parametrize("stage", range(4))
def test_evaluate_equals_single_process_eval_and_leaves_training_alone(runs, stage):
    ranks, plain = runs[f"eval{stage}"], runs[f"noeval{stage}"]
    weights = [r["weights"] for r in ranks]
    worst = 0.0
    rank0 = ranks[0]["buffers"]  # what every worker evaluates with ([Note: buffers follow DDP])
    for rank, result in enumerate(ranks):
        want = _reference_eval(weights, rank0, rank)
        for got, ref in zip(result["evals"], want):
            assert set(got) == {"loss", "acc", "max_logit"}
            for key in ref:
                assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-6), (rank, key)
                worst = max(worst, abs(got[key] - ref[key]))
        in_train_mode = _reference_eval(weights, rank0, rank, train_mode=True)
        assert all(abs(a["loss"] - b["loss"]) > 1e-3 for a, b in zip(want, in_train_mode))  # eval mode matters
        assert result["rng_unchanged"] and result["no_grads"] and result["training_after"]
        assert result["step_count"] == 2
        assert result["seen"] == [(rank, WORLD)]  # zeroray.worker_context() in loss_fn
        assert all(torch.equal(rank0[k], result["buffers_after"][k]) for k in rank0)  # rank 0's, unchanged
    assert not all(torch.equal(ranks[0]["buffers"][k], ranks[1]["buffers"][k]) for k in ranks[0]["buffers"]
                   if k.endswith("running_mean"))  # each worker's own statistics before the call: rank 0's won
    # Training after the evaluation is exactly training without it.
    for with_eval, without in zip(ranks, plain):
        assert with_eval["losses"] == without["losses"]
        for name, (lo, hi, t) in with_eval["final"].items():
            assert torch.equal(t, without["final"][name][2]), name
        counts = lambda fetch: [{k: v for k, v in f.items() if k != "fetch_wait_s"} for f in fetch]  # noqa: E731
        assert counts(with_eval["fetch"]) == counts(without["fetch"])  # the same fetches, hits and rounds
        if stage == 3:
            for f in with_eval["fetch"][1:]:  # the trace recorded at step 1 is followed after the evaluation
                assert f["rounds"] == 0 and f["plan_exits"] == 0 and f["prefetch_hits"] > 0, f
    print(f"stage {stage}: evaluate vs single-process eval, max |diff| {worst:.2e}")


def test_run_generates_to_different_lengths_per_rank_without_hanging(runs):
    ranks = runs["run3"]
    tokens = [r["tokens"] for r in ranks]
    assert [t.shape[1] for t in tokens] == [3 + 3, 3 + 7]  # each rank stopped at its own length
    # Greedy decoding on the same weights: the shorter run is a prefix of the longer one.
    assert torch.equal(tokens[1][:, :6], tokens[0])
    assert [r["error"] for r in ranks] == ["PeerStepError", "KeyError"]  # every rank raised, none hung
    assert all(r["context_outside"] == "raises" for r in ranks)
    # The group is in step after both calls: training goes on, following stage 3's trace, exactly
    # as without them.
    for r, plain in zip(ranks, runs["norun3"]):
        assert all(f["rounds"] == 0 and f["plan_exits"] == 0 for f in r["fetch"]), r["fetch"]
        assert r["losses"] == plain["losses"]
        assert all(torch.equal(t, plain["state"][n][2]) for n, (_, _, t) in r["state"].items())
