"""Stage-3 steps whose workers take different branches, with small gradient buckets (found by
the issue-24 fuzzer: 3 of 300 cases hung, in the grammar of the time; pinned here as explicit
models, tests/conformance's cases change with the grammar).

Worker 0 routes to module ``b`` and worker 1 to ``a`` (tests.models.DivergentNet; a third
worker to ``b``), so each step is negotiated (fetch/negotiate.py). With 40-byte buckets a worker's
backward waits for the reduction of an early bucket before it can fill the next one; the
bucket holding ``b``'s gradient is complete only on worker 0, and worker 1 launched the
buckets its backward left incomplete only after the rounds that end the micro-batch, rounds
that wait for worker 0 to finish its backward: a deadlock, which ended in a CollectiveError
after the group's timeout. The same happened when worker 1's ``loss_fn`` raised (it goes
through the rounds to keep its peers going, [Note: step outcome] in errors.py). Now a worker
launches those buckets first, while its waits still only answer rounds
(UnitFetcher._launch_before_done). Launching them after the worker said it was done
still deadlocked with 3 workers routing rows to experts (the second test, the fuzzer's
cases pinned): a wait inside the launch then took the worker into the done-rounds, and the
buckets after it were never launched.
"""
import torch

import zeroray as zr
from tests.conformance.case import build_case
from tests.conformance.configs import RunConfig
from tests.conformance.driver import run_case_list
from tests.conformance.grammar import ModelSpec
from tests.dist.harness import run_engines
from tests.dist.test_engine_parity import ADAMW, assert_parity, ref_adamw
from tests.models import divergent_batches, divergent_model, lm_loss, per_shard_loss, reference_run


def poisoned_lm_loss(model, batch):
    idx, tgt, poison = batch
    if bool(poison.any()):
        raise ValueError("poisoned batch")
    return lm_loss(model, (idx, tgt))


def _zero(**kw):
    return zr.ZeroConfig(stage=3, wrap="module", bucket_bytes=40, **kw)


def test_diverging_workers_with_small_buckets_train_exactly_and_fail_together():
    # Every step diverges (so every module is used by some worker in every step); 2 and 3 workers
    # in one set of 3 processes.
    cases = [(world, k, divergent_batches(4, world=world, batch=4 * world)) for world in (2, 3) for k in (1, 2)]
    specs = [dict(model_fn=divergent_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                  zero=_zero(grad_accum_steps=k), batches=b, world=world) for world, k, b in cases]
    for (world, k, batches), (results, params) in zip(cases, run_engines(3, specs)):
        ref = reference_run(divergent_model, per_shard_loss(lm_loss, world * k), ref_adamw, batches)
        try:
            assert_parity(ref, results, params)
        except AssertionError as e:
            raise AssertionError(f"{world} workers, grad_accum_steps={k}: {e}") from None

    # Worker 1's loss_fn raises in step 1 before its forward: both workers raise, neither hangs.
    poisoned = []
    for step, (idx, tgt) in enumerate(divergent_batches(3, world=2, batch=8)):
        poison = torch.zeros(idx.shape[0], dtype=torch.bool)
        poison[-1] = step == 1
        poisoned.append((idx, tgt, poison))
    try:
        run_engines(2, [dict(model_fn=divergent_model, loss_fn=poisoned_lm_loss, optimizer=zr.AdamW(**ADAMW),
                             zero=_zero(), batches=poisoned)])
    except RuntimeError as e:
        text = str(e)
    else:
        raise AssertionError("the poisoned step did not raise")
    assert "ValueError: poisoned batch" in text and "PeerStepError" in text, text
    assert "CollectiveError" not in text, text


def test_three_workers_routing_rows_with_small_buckets_match_pytorch():
    """The fuzzer's hung cases' models and configurations (conformance runner and oracle)."""
    route_bn = ModelSpec(vocab=11, dim=5, heads=2, blocks=("route", "bn", "ln", "scale"), experts=2,
                         positions="sinusoidal", head="tied", l2=False)
    frozen_route = ModelSpec(vocab=13, dim=5, heads=2, blocks=("frozen", "route"), experts=3, positions="none",
                             head="loss_fn", l2=False)
    cases = [build_case(1, route_bn, RunConfig(world=3, steps=3, rows=3, zero={
                 "stage": 3, "wrap": "module", "bucket_bytes": 64, "reuse_distance": 0}))]
    cases += [build_case(seed, frozen_route, RunConfig(world=3, steps=3, rows=3, zero={
                  "stage": 3, "max_grad_norm": 0.05, "bucket_bytes": 40})) for seed in (1, 2)]
    for outcome in run_case_list(cases):
        assert outcome.verdict.ok, f"{outcome.line()}\n{outcome.verdict.detail}"

