"""User collectives on torch.distributed's default group while stage 3's workers run different
modules (found by the issue-41 fuzzer, GAPS["diverge_dist"] in tests/conformance/case.py).

The rows of each worker route to different experts, so every fetch is negotiated
([Note: negotiated fetch] in zeroray/fetch/negotiate.py). A worker that had one more unit to
fetch than its peer waited in a round, while the peer already sat in the user's collective
(``dist.all_reduce`` in ``loss_fn``, or a SyncBatchNorm after the routed block, forward and
backward), which takes no part in zeroray's rounds: both blocked until the collective timeout
and failed with gloo's "Timed out waiting ... for recv". Now a helper thread answers rounds for
a worker whose compute thread is outside zeroray ([Note: answering rounds outside zeroray] in
zeroray/fetch/unit_fetcher.py). Each case is compared with single-process PyTorch on the
global batches (the conformance oracle), on 2 and 3 workers, with accumulation, and one
evaluates after training (``loss_fn``'s all_reduce in an inference call, every fetch negotiated).
"""
from tests.conformance.case import build_case
from tests.conformance.configs import RunConfig
from tests.conformance.driver import run_case_list
from tests.conformance.grammar import ModelSpec


def _stage3(world, **zero):
    return RunConfig(world=world, steps=3, rows=3, zero={"stage": 3, "wrap": "module", **zero})


def test_user_collectives_after_divergent_routing_match_pytorch():
    # dist.all_reduce in loss_fn after the routed block, the head read in loss_fn (one more fetch
    # there on whichever worker freed it), with an L2 term reading every parameter
    all_reduce = ModelSpec(vocab=13, dim=6, heads=2, blocks=("linear", "route"), experts=3, positions="none",
                           head="loss_fn", l2=True, dist_loss=True)
    # SyncBatchNorm after the routed block (its forward's and backward's all_reduces), tied head
    sync_bn = ModelSpec(vocab=11, dim=5, heads=2, blocks=("route", "bn", "ln"), experts=2, positions="none",
                        head="tied", l2=False, sync_bn=True)
    both = ModelSpec(vocab=11, dim=5, heads=2, blocks=("route", "bn", "linear"), experts=3, positions="sinusoidal",
                     head="own", l2=False, sync_bn=True, dist_loss=True)
    cases = [build_case(1, all_reduce, _stage3(2), evaluate=True), build_case(2, all_reduce, _stage3(2, grad_accum_steps=2)),
             build_case(3, sync_bn, _stage3(2)), build_case(4, both, _stage3(3, grad_accum_steps=2)),
             build_case(5, all_reduce, _stage3(3, reuse_distance=0))]
    for case in cases:
        assert "diverge_dist" in case.gaps(), case.describe()
    for outcome in run_case_list(cases):
        assert outcome.verdict.ok, f"{outcome.line()}\n{outcome.verdict.detail}"
