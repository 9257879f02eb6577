"""The oracle's rules are DDP's: fuzz cases trained by torch DDP (gloo, 2 processes) equal the
single-process oracle (oracle.py), so checking zeroray against the oracle checks it against DDP.

The cases are chosen to hit every rule the oracle claims from DDP: each worker's loss is the
mean over its own rows (padding, BatchNorm, routing make that differ from the global mean),
gradients averaged over workers and accumulated over micro-batches (``no_sync``), experts
that run on one worker only, and in some steps on none (DDP leaves their ``.grad`` None and
AdamW skips them), BatchNorm running statistics as rank 0 has them, clipping by the global
norm, tied weights, a module called twice, one module under two names, frozen parameters.
DDP cannot read parameters in ``loss_fn`` outside its forward (ddp.py), so these cases do not.
"""
from tests.conformance.case import build_case
from tests.conformance.configs import RunConfig
from tests.conformance.ddp import run_ddp
from tests.conformance.grammar import ModelSpec
from tests.conformance.oracle import reference_run

WORLD = 2
M1 = ModelSpec(vocab=11, dim=6, heads=2, blocks=("linear", "route", "bn", "twice", "frozen", "mha"), experts=3,
               positions="sinusoidal", head="tied", l2=False)
M2 = ModelSpec(vocab=13, dim=7, heads=1, blocks=("linear", "route", "again", "conv", "ln", "scale"), experts=2,
               positions="none", head="own", l2=False)


def _cases():
    # (seed, model, accumulation, clipping): seeds whose batches leave an expert unused on every
    # worker in some step (checked below)
    out = []
    for seed, model, accum, clip in ((0, M1, 1, 0.05), (0, M2, 2, None), (1, M1, 2, None)):
        zero = {"stage": 3, "grad_accum_steps": accum, **({"max_grad_norm": clip} if clip else {})}
        out.append(build_case(seed, model, RunConfig(world=WORLD, steps=4, rows=2, zero=zero), padded=True,
                              unused=True))
    return out


def test_ddp_equals_the_oracle():
    cases = _cases()
    for case, ranks in zip(cases, run_ddp(WORLD, cases)):
        ref = reference_run(case)
        where = case.describe()
        assert any(ref.unused), f"{where}: no step leaves an expert unused on every worker"
        losses = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(case.config.steps)]
        for step, (a, b) in enumerate(zip(losses, ref.losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{where}: step {step}: DDP loss {a} vs oracle {b}"
        assert ranks[0]["unused"] == ref.unused, where
        for name, want in ref.state.items():  # parameters, and rank 0's buffers
            err = (ranks[0]["state"][name].double() - want.double()).abs().max().item()
            assert err <= 1e-5, f"{where}: {name}: DDP vs oracle max abs diff {err:.2e}"
