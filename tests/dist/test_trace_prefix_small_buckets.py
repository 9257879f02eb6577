"""Stage 3: a worker whose step is a prefix of the followed trace, with small gradient buckets
(found by the issue-41 fuzzer, seed 7700049: a gloo send timeout; pinned here as an explicit
model, tests/conformance's cases change with the grammar).

The routed block comes first, so its experts' backward comes last. In step 1 both workers run
every expert they route to alike and agree on a trace; in step 2 worker 1's rows leave expert 0
unused, so its backward ends one event short of the trace: a prefix, which leaves no plan exit
for the peer to see. Worker 1 launched the buckets its backward left short of gradients before
it took part in the rest of the plan's gathers; with 40-byte buckets a launch waits for the
reduction of an earlier bucket, which worker 0 launches only after the backward it is waiting in
for one of those gathers: both blocked until the collective timeout. The same when worker 1's
``loss_fn`` raises in a followed step (it aborts with the whole plan still to take part in).
Now the rest of the plan is issued first ([Note: the plan's rest before the reductions] in
zeroray/fetch/unit_fetcher.py). Neither the optimizer nor the user collective was needed; the
fuzzer's combination (torch.optim.Muon, ``dist.all_reduce`` in ``loss_fn``) is pinned beside the
plain one.
"""
import dataclasses
import functools

import pytest
import torch

import zeroray as zr
from tests.conformance.case import build_case
from tests.conformance.configs import RunConfig
from tests.conformance.driver import run_case_list
from tests.conformance.grammar import Attention, FuzzNet, ModelSpec, Residual, Route, fuzz_loss
from tests.dist.harness import run_engines
from tests.dist.test_engine_parity import ADAMW

SPEC = ModelSpec(vocab=13, dim=6, heads=2, blocks=("route", "twice", "conv", "twice"), experts=3, positions="none",
                 head="tied", l2=False)
ZERO = {"stage": 3, "wrap": (Residual, Attention, Route), "bucket_bytes": 40, "max_live_bytes": 200}
# worker 0 takes the first two rows of each global batch, worker 1 the last two
ROUTES = ([2, 0, 2, 0], [2, 0, 2, 2])  # step 1: both route alike; step 2: worker 1 uses no expert 0


def _case(seed: int, spec: ModelSpec, optimizer: str):
    case = build_case(seed, spec, RunConfig(world=2, steps=len(ROUTES), rows=2, zero=dict(ZERO), optimizer=optimizer))
    for batch, route in zip(case.batches, ROUTES):
        batch["route"] = torch.tensor(route)
    return case


@pytest.mark.timeout(420)  # a hang ends in the collective timeout (120 s) a case
def test_a_worker_on_a_prefix_of_the_trace_with_small_buckets_matches_pytorch():
    cases = [_case(1, SPEC, "adam"),  # the cause alone
             _case(2, dataclasses.replace(SPEC, dist_loss=True), "muon")]  # the fuzzer's combination
    for case in cases:
        assert {"unused", "diverge_dist"} & case.gaps(), case.describe()
    for outcome in run_case_list(cases):
        assert outcome.verdict.ok, f"{outcome.line()}\n{outcome.verdict.detail}"


def _poisoned_loss(spec, model, batch):
    if bool(batch["poison"].any()):
        raise ValueError("poisoned batch")
    return fuzz_loss(spec, model, batch)


@pytest.mark.timeout(300)
def test_a_worker_whose_loss_fn_raises_in_a_followed_step_with_small_buckets_fails_together():
    case = _case(3, SPEC, "adam")
    batches = []
    for step, batch in enumerate(case.batches):
        poison = torch.zeros(batch["idx"].shape[0], dtype=torch.bool)
        poison[-1] = step == 1  # worker 1's rows, in the step after the trace was adopted
        batches.append({**batch, "route": torch.tensor(ROUTES[0]), "poison": poison})
    with pytest.raises(RuntimeError) as raised:
        run_engines(2, [dict(model_fn=functools.partial(FuzzNet, SPEC), loss_fn=functools.partial(_poisoned_loss, SPEC),
                             optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(**ZERO), batches=batches, seed=3)])
    text = str(raised.value)
    assert "ValueError: poisoned batch" in text and "PeerStepError" in text, text
    assert "CollectiveError" not in text, text
