"""Global batches whose rows do not divide over the workers (and micro-batches), against PyTorch.

[Note: uneven splits] in zeroray/engine/batch.py: 7 rows over 3 workers go as 3, 2, 2 (with
two micro-batches each: 2+1, 1+1, 1+1), and each part's loss is weighted by its share of the
rows, ``n_p / N``. Two oracles, both single-process PyTorch:

- a per-row mean loss (``lm_loss``: the mean over rows of equal length): the step is plain
  training on the whole global batch, at every stage, 2 and 3 workers, with and without
  accumulation and clipping;
- a per-token mean over padding (Hugging Face's GPT-2 on a padding collator's batches, labels
  -100 at the padding): the step's loss is ``sum_p n_p / N * L_p`` over the parts (workers, then
  micro-batches), ``L_p`` the part's own per-token mean; with equal parts that is DDP's mean of
  the workers' per-token means (tests/dist/test_variable_shapes.py).

Each test also checks that its oracle is told apart from the nearest wrong one (the plain mean
of the parts' losses; the whole batch's per-token mean), so a weighting left out would fail.
The token cases' bound is DDP's (tests/dist/ddp_run.py: torch DDP on the same rows and row
weights, written from the rule, not from zeroray's code), as [Note: parity bound] in
tests/dist/parity.py says why; the row cases keep its fixed floor. Everything runs in one set
of 3 processes.
"""
import functools

import pytest
import torch

import zeroray as zr
from tests.dist.ddp_run import ddp_spec, fused_adamw
from tests.dist.harness import run_engine_table
from tests.dist.parity import assert_parity, ddp_state, global_losses
from tests.models import lm_loss, make_batches, parity_model, reference_run
from tests.padded_data import hf_loss, padded_batches
from tests.real_models import hf_gpt2
from zeroray.engine.batch import split_batch

ROWS, STEPS = 7, 5
ADAMW = dict(lr=1e-2, weight_decay=0.1)
HF_ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-5)  # eps: tests/dist/test_real_models.py says why
LONGEST = (6, 11, 4, 16, 9)

ROW_CASES = {  # name: (workers, stage, ZeroConfig extras)
    **{f"W3-stage{s}": (3, s, {}) for s in range(4)},
    "W2-stage3": (2, 3, {}),
    "W3-stage0-accum2": (3, 0, {"grad_accum_steps": 2}),
    "W3-stage1-accum2": (3, 1, {"grad_accum_steps": 2}),
    "W3-stage3-accum2-clip": (3, 3, {"grad_accum_steps": 2, "max_grad_norm": 0.05}),
    "W2-stage2-clip": (2, 2, {"max_grad_norm": 0.05}),
}
TOKEN_CASES = {  # name: (workers, stage, grad_accum_steps); the row cases cover every stage
    "W3-stage0": (3, 0, 1),
    "W3-stage3": (3, 3, 1),
    "W3-stage2-accum2": (3, 2, 2),
}


def row_batches():
    return make_batches(STEPS, batch=ROWS, seed=11)


def token_batches():
    return padded_batches(LONGEST, rows=ROWS, seed=4)


@pytest.fixture(scope="module")
def runs():
    table = {}
    for name, (world, stage, extra) in ROW_CASES.items():
        table[("row", name)] = (world, dict(model_fn=parity_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                                            zero=zr.ZeroConfig(stage=stage, **extra), batches=row_batches()))
    for name, (world, stage, accum) in TOKEN_CASES.items():
        table[("token", name)] = (world, dict(model_fn=hf_gpt2, loss_fn=hf_loss, optimizer=zr.AdamW(**HF_ADAMW),
                                              zero=zr.ZeroConfig(stage=stage, grad_accum_steps=accum),
                                              batches=token_batches()))
    for world, accum in {(world, accum) for world, _, accum in TOKEN_CASES.values()}:
        table[("ddp", world, accum)] = (world, ddp_spec(model_fn=hf_gpt2, loss_fn=hf_loss,
                                                        optimizer=fused_adamw(**HF_ADAMW), accum=accum,
                                                        batches=token_batches()))
    return run_engine_table(table)


def _parts(batch, world, accum):
    """The parts zeroray cuts: workers, then each worker's share over its micro-batches."""
    return [mb for share in split_batch(batch, world) for mb in split_batch(share, accum)]


@functools.lru_cache(maxsize=None)
def token_reference(world, accum, weighted=True):
    """Single-process PyTorch on ``token_batches()``: per step, ``sum_p n_p / N * hf_loss(part_p)``
    (``weighted=False``: the plain mean over the parts, what an equal split would give):
    (losses, global gradient norms, state dict)."""
    batches = token_batches()
    torch.manual_seed(0)
    model = hf_gpt2()
    opt = torch.optim.AdamW(model.parameters(), **HF_ADAMW)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        parts = _parts(batch, world, accum)
        rows = batch["input_ids"].shape[0]
        if weighted:
            loss = sum(hf_loss(model, p) * (p["input_ids"].shape[0] / rows) for p in parts)
        else:
            loss = sum(hf_loss(model, p) for p in parts) / len(parts)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.lru_cache(maxsize=None)
def row_reference(clip, plain_parts=None, plain_accum=1):
    """Plain single-process training on the whole of each ``row_batches()`` batch; with
    ``plain_parts``, on the plain mean of the losses of the parts an equal-weight split would
    average (workers x ``plain_accum`` micro-batches)."""
    loss_fn = lm_loss if plain_parts is None else (
        lambda m, b: sum(lm_loss(m, p) for p in _parts(b, plain_parts, plain_accum)) / (plain_parts * plain_accum))
    return reference_run(parity_model, loss_fn, lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], **ADAMW), row_batches(), max_grad_norm=clip)


def _max_diff(params, state):
    return max((params[k].reshape(v.shape) - v).abs().max().item() for k, v in state.items() if k in params)


def test_split_sizes_are_what_the_oracles_cut():
    batch = row_batches()[0]
    assert [p[0].shape[0] for p in split_batch(batch, 3)] == [3, 2, 2]
    assert [p[0].shape[0] for p in _parts(batch, 3, 2)] == [2, 1, 1, 1, 1, 1]
    assert [p["input_ids"].shape[0] for p in _parts(token_batches()[0], 3, 1)] == [3, 2, 2]


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_per_row_mean_loss_is_the_whole_batch_step(runs, name):
    """Plain single-process training on the whole batch: losses rel 1e-5, parameters 1e-5, and
    with clipping the global gradient norm of the whole batch."""
    world, stage, extra = ROW_CASES[name]
    clip, accum = extra.get("max_grad_norm"), extra.get("grad_accum_steps", 1)
    ref = row_reference(clip)
    results, params = runs[("row", name)]
    trained = {k: v for k, v in ref[2].items() if k in params}
    assert_parity((ref[0], None, trained), results, params)
    assert results[0]["norms"] == pytest.approx(ref[1], rel=1e-5)
    # The weighting matters here: the plain mean of the parts' losses trains another model.
    assert _max_diff(params, row_reference(clip, world, accum)[2]) > 1e-3
    print(f"{name}: max |weight - whole-batch PyTorch| {_max_diff(params, trained):.1e}, "
          f"losses {[round(x, 5) for x in global_losses(results)]}")


@pytest.mark.parametrize("name", list(TOKEN_CASES))
def test_per_token_mean_is_the_row_weighted_mean_of_the_parts(runs, name):
    world, stage, accum = TOKEN_CASES[name]
    assert all((b["labels"] == -100).any() for b in token_batches())  # padding, masked in the labels
    ref = token_reference(world, accum)
    results, params = runs[("token", name)]
    ddp = runs[("ddp", world, accum)]
    trained = {k: v for k, v in ref[2].items() if k in params}
    assert_parity((ref[0], ref[1], trained), results, params, ddp=ddp)
    plain = token_reference(world, accum, weighted=False)[2]
    whole = token_reference(1, 1)[2]  # the global per-token mean
    assert _max_diff(params, plain) > 1e-3 and _max_diff(params, whole) > 1e-3
    print(f"{name}: max |weight - oracle| {_max_diff(params, trained):.1e} (DDP's "
          f"{_max_diff(ddp_state(ddp), trained):.1e}, zeroray - DDP {_max_diff(params, ddp_state(ddp)):.1e}; "
          f"plain mean of the parts "
          f"{_max_diff(params, plain):.1e}, whole batch's token mean {_max_diff(params, whole):.1e})")
