"""Exact parity of every stage with single-process PyTorch, in plain torch gloo processes.

Every configuration of every world size runs in one set of 3 processes (start-up dominates), a
run on ranks 0..world-1 of it; each test checks its own runs.
"""
import pytest
import torch

import zeroray as zr
from tests.dist.harness import run_engine_table
from tests.dist.parity import assert_parity, global_losses  # noqa: F401 (the other parity tests import them here)
from tests.models import branch_model, lm_loss, make_batches, parity_model, reference_run

STEPS = 10
ADAMW = dict(lr=1e-2, weight_decay=0.1)


def ref_adamw(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **ADAMW)


def _spec(stage, batches, model_fn=parity_model, **zero):
    return dict(model_fn=model_fn, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                zero=zr.ZeroConfig(stage=stage, **zero), batches=batches)


# (name, spec factory, reference factory); the spec gets the batches.
CASES = {
    **{f"stage{s}": (lambda b, s=s: _spec(s, b), "adamw") for s in range(4)},
    # ZeRO-3 coordinator settings: no prefetch, tiny buckets (many buckets), no reuse, tight budgets.
    "stage3-noprefetch": (lambda b: _spec(3, b, prefetch=False), "adamw"),
    "stage3-tiny-buckets": (lambda b: _spec(3, b, bucket_bytes=64, prefetch_bytes=64, max_live_bytes=200,
                                            reuse_distance=0), "adamw"),
    "stage2-tiny-buckets": (lambda b: _spec(2, b, bucket_bytes=40), "adamw"),
    # A window smaller than any module and no reuse: every unit is gathered again in backward.
    "stage3-regather": (lambda b: _spec(3, b, prefetch_bytes=64, reuse_distance=0), "adamw"),
    # A data-dependent branch (same on every rank). A module skipped in a step has no gradient and
    # the optimizer skips it, as in plain torch (tests/dist/test_unused_params.py).
    "stage3-branch": (lambda b: _spec(3, b, model_fn=branch_model), "branch"),
}


PARITY_WORLDS, BRANCH_WORLDS = (1, 2, 3), (2, 3)


@pytest.fixture(scope="module")
def references():
    batches = make_batches(STEPS)
    return batches, {"adamw": reference_run(parity_model, lm_loss, ref_adamw, batches),
                     "branch": reference_run(branch_model, lm_loss, ref_adamw, batches)}


def _parity_names(world):
    return list(CASES) if world > 1 else [f"stage{s}" for s in range(4)]


@pytest.fixture(scope="module")
def runs(references):
    """Both tests' runs at every world size, in one set of processes: key -> (results, params)."""
    batches, _ = references
    table = {("parity", world, name): (world, CASES[name][0](batches))
             for world in PARITY_WORLDS for name in _parity_names(world)}
    table.update({("branch", world, i): (world, _branch_spec(*case))
                  for world in BRANCH_WORLDS for i, case in enumerate(_branch_cases(world))})
    return run_engine_table(table)


@pytest.mark.parametrize("world", PARITY_WORLDS)
def test_parity_every_stage_and_coordinator_setting(references, runs, world):
    _, refs = references
    names = _parity_names(world)
    for name in names:
        results, params = runs[("parity", world, name)]
        try:
            assert_parity(refs[CASES[name][1]], results, params)
        except AssertionError as e:
            raise AssertionError(f"{name}, {world} workers: {e}") from None
        if name == "stage3-tiny-buckets":
            # Many buckets, but the pool of bucket buffers stops growing after the first step.
            pools = [rep["bucket_pool"] for rep in results[0]["reports"]]
            assert pools[-1] == pools[1], pools
        if name == "stage0" and world > 1:
            stage0_bytes = results[0]["reports"][-1]["total_bytes"]
        if name in ("stage1", "stage2") and world > 1:
            # The paper: reduce-scatter + all-gather moves what one all-reduce does (2Φ).
            ratio = results[0]["reports"][-1]["total_bytes"] / stage0_bytes
            assert 0.95 <= ratio <= 1.05, (name, ratio)
        if name == "stage3" and world > 1:
            # The whole model fits the default prefetch window, so what forward gathered stays
            # gathered through backward: one all-gather and one reduce-scatter, 2Φ.
            ratio = results[0]["reports"][-1]["total_bytes"] / stage0_bytes
            assert 0.95 <= ratio <= 1.05, (name, ratio)
            fetch = results[0]["reports"][-1]["fetch"]
            assert fetch["prefetch_hits"] > fetch["on_demand"], fetch
        if name == "stage3-regather" and world > 1:
            # The paper's 3Φ against 2Φ, or more: this model also uses the tied embedding and
            # the shared layer twice in forward, and without reuse each use gathers again.
            ratio = results[0]["reports"][-1]["total_bytes"] / stage0_bytes
            assert ratio >= 1.45, (name, ratio)
            print(f"{world} workers: bytes per step vs stage 0: stage 3 {ratio:.3f}")


def _branch_cases(world):
    """(model_fn, wrap, agree_first, grad_accum_steps, batches) of the branch test at ``world``."""
    from tests.models import divergent_accum_batches, divergent_batches, divergent_model, routed_model

    cases = []
    for model_fn, wrap in ((divergent_model, "module"), (routed_model, "auto"), (divergent_model, "auto")):
        for agree_first in (0, 2):
            batches = divergent_batches(5, agree_first=agree_first, world=world, batch=4 * world)
            cases.append((model_fn, wrap, agree_first, 1, batches))
    # With gradient accumulation the micro-batches of one worker diverge too.
    for model_fn, wrap in ((divergent_model, "module"), (routed_model, "auto")):
        cases.append((model_fn, wrap, 2, 2, divergent_accum_batches(5, world)))
    return cases


def _branch_spec(model_fn, wrap, agree_first, k, batches):
    return dict(model_fn=model_fn, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                zero=zr.ZeroConfig(stage=3, wrap=wrap, grad_accum_steps=k), batches=batches)


@pytest.mark.parametrize("world", BRANCH_WORLDS)
def test_ranks_taking_different_branches_train_exactly(runs, world):
    """Data-dependent control flow at stage 3 (issue 13 item 6): every worker's share routes on
    its own data, so the workers run different modules, gather different units and produce
    different gradients. Whether they diverge from the first step (no trace yet: every fetch is
    negotiated) or only after following a trace for two steps (a worker leaves the plan in the
    middle of forward), the result equals the reference in which each share routes on its own."""
    from tests.models import per_shard_loss, routed_model

    for i, (model_fn, wrap, agree_first, k, batches) in enumerate(_branch_cases(world)):
        results, params = runs[("branch", world, i)]
        ref = reference_run(model_fn, per_shard_loss(lm_loss, world * k), ref_adamw, batches)
        try:
            assert_parity(ref, results, params)
        except AssertionError as e:
            raise AssertionError(f"{model_fn.__name__}, wrap={wrap}, agree_first={agree_first}, "
                                 f"grad_accum_steps={k}: {e}") from None
        fetch = [rep.get("fetch", {}) for rep in results[0]["reports"]]
        if wrap == "module" or model_fn is routed_model:
            # the steps where the workers diverged were negotiated: rounds happened
            assert any(f.get("rounds", 0) for f in fetch[max(agree_first, 1):]), fetch
        if agree_first and wrap == "module":
            assert any(f.get("plan_exits", 0) for f in fetch), fetch  # a worker left the plan mid-step
