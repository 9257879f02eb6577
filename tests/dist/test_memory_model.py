"""The paper's memory model, measured: model-state bytes per worker vs the estimate (issue 5).

Each configuration trains two steps in plain torch gloo processes (one process set per world
size, every configuration in it). Three figures are compared per rank:
- ``measured``: bytes of the storages the engine holds (memory_report.measure);
- ``estimate``: zeroray.memory's per-stage formulas on the padded layout, with zeroray's
  documented deviations (memory_report.expected_model_state); never read off the tensors;
- ``live_tensor_bytes``: a gc census of every floating-point tensor storage the process
  gained since before the engine was built. It does not ask the engine anything, so it
  catches a copy measure() would not see (a unit buffer left gathered, a leaked gradient).

The same runs check C_B: the bucket and gather-staging pools stay at a small multiple of
``bucket_bytes`` for a model 25x larger.
"""
import functools

import pytest

import zeroray as zr
from examples import gpt
from tests.dist.harness import run_engines

SMALL = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)   # ~0.12M parameters
LARGE = gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=32)  # ~3.2M parameters
BUCKET_BYTES = 64 * 2**10
STEPS = 2


def _batches(world):
    return list(gpt.CharBatches(2 * world, 32, STEPS, seed=1))


def _spec(cfg, stage, dtype, world):
    return dict(model_fn=functools.partial(gpt.GPT, cfg), loss_fn=gpt.gpt_loss, optimizer=zr.AdamW(lr=1e-3),
                zero=zr.ZeroConfig(stage=stage, dtype=dtype, bucket_bytes=BUCKET_BYTES),
                batches=_batches(world), census=True)


TABLE = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in range(4)]
POOLS = [0, 2, 3]  # all-reduce buckets, reduce-scatter buckets, + stage-3 gathers


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_the_estimate(world):
    specs = [_spec(SMALL, s, d, world) for s, d in TABLE]
    if world == 2:
        specs += [_spec(cfg, s, "fp32", world) for cfg in (SMALL, LARGE) for s in POOLS]
    runs = run_engines(world, specs)

    for (stage, dtype), (results, _) in zip(TABLE, runs):
        for rank, r in enumerate(results):
            mem, where = r["memory"], f"stage {stage} {dtype}, {world} workers, rank {rank}"
            measured, estimate = mem["measured"], mem["estimate"]
            for key in ("params", "grads", "optimizer", "total"):
                assert measured[key] == pytest.approx(estimate[key], rel=0.02), (where, key, measured, estimate)
            # Everything the process gained is the model states plus the bucket pools: no hidden copy.
            expected_live = measured["total"] + mem["bucket_buffers"]
            assert mem["live_tensor_bytes"] == pytest.approx(expected_live, rel=0.01), (where, mem)
            # Sharding shrinks what it should: the parameter term is 1/W of the padded model at stage 3.
            elem = 4 if dtype == "fp32" else 2
            if stage == 3:
                assert measured["params"] == elem * mem["padded_numel"] // world, (where, measured)

    if world == 2:
        pools = runs[len(TABLE):]
        small, large = pools[:len(POOLS)], pools[len(POOLS):]
        for stage, (rs, _), (rl, _) in zip(POOLS, small, large):
            s, l = rs[0]["memory"], rl[0]["memory"]
            assert l["measured"]["total"] > 50 * BUCKET_BYTES  # the model is far larger than one bucket
            for key in ("reduce_buffers", "gather_buffers"):
                # A pool holds a few buffers of at most bucket_bytes (plus the 1/W output rows).
                assert l[key] <= 4 * BUCKET_BYTES, (stage, key, l[key])
                assert l[key] <= max(s[key], 1) * 2, (stage, key, s[key], l[key])
