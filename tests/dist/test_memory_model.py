"""The paper's memory model, measured: model-state bytes per worker vs the estimate (issue 5).

Each configuration trains two steps in plain torch gloo processes: one set of 4 processes
serves every world size (a spec of world w runs on the first w ranks). Three figures are compared per rank:
- ``measured``: bytes of the storages the engine holds (memory_report.measure);
- ``estimate``: zeroray.memory.model's per-stage formulas on the padded layout, with zeroray's
  documented deviations (memory_report.expected_model_state); never read off the tensors;
- ``live_tensor_bytes``: a gc census of every floating-point tensor storage the process
  gained since before the engine was built. It does not ask the engine anything, so it
  catches a copy measure() would not see (a unit buffer left gathered, a leaked gradient).

The same runs check C_B: the bucket and gather-staging pools stay at a small multiple of
``bucket_bytes`` for a model 25x larger. M_D: in one process, neither the live tensor bytes
nor the RSS grow from step 5 to step 50.
"""
import functools
import gc
import os

import pytest
import torch

import zeroray as zr
from examples import gpt
from tests.dist.harness import run_engines
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.memory.report import live_tensor_bytes

SMALL = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)   # ~0.12M parameters
LARGE = gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=32)  # ~3.2M parameters
BUCKET_BYTES = 64 * 2**10
STEPS = 2


def _batches(world):
    return list(gpt.CharBatches(2 * world, 32, STEPS, seed=1))


def _spec(cfg, stage, dtype, world):
    return dict(model_fn=functools.partial(gpt.GPT, cfg), loss_fn=gpt.gpt_loss, optimizer=zr.AdamW(lr=1e-3),
                zero=zr.ZeroConfig(stage=stage, dtype=dtype, bucket_bytes=BUCKET_BYTES),
                batches=_batches(world), census=True, world=world)


TABLE = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in range(4)]
POOLS = [0, 2, 3]  # all-reduce buckets, reduce-scatter buckets, + stage-3 gathers
WORLDS = (4, 2, 1)  # widest first: ranks beyond a spec's world finish early
_RUNS = {}


def runs(key):
    """Every configuration of every world size, in one set of 4 processes, once per session."""
    if not _RUNS:
        keys, specs = [], []
        for w in WORLDS:
            for stage, dtype in TABLE:
                keys.append((w, "table"))
                specs.append(_spec(SMALL, stage, dtype, w))
            if w == 2:
                for cfg in (SMALL, LARGE):
                    for stage in POOLS:
                        keys.append((2, "pools"))
                        specs.append(_spec(cfg, stage, "fp32", 2))
        for run_key, run in zip(keys, run_engines(max(WORLDS), specs)):
            _RUNS.setdefault(run_key, []).append(run)
    return _RUNS[key]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_the_estimate(world):
    for (stage, dtype), (results, _) in zip(TABLE, runs((world, "table"))):
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


def test_bucket_pools_stay_at_their_configured_size():
    pools = runs((2, "pools"))
    small, large = pools[:len(POOLS)], pools[len(POOLS):]
    for stage, (rs, _), (rl, _) in zip(POOLS, small, large):
        s, l = rs[0]["memory"], rl[0]["memory"]
        assert l["measured"]["total"] > 50 * BUCKET_BYTES  # the model is far larger than one bucket
        for key in ("reduce_buffers", "gather_buffers"):
            # A pool holds a few buffers of at most bucket_bytes (reduce-scatter: plus its 1/W output).
            assert l[key] <= 4 * (BUCKET_BYTES + BUCKET_BYTES // 2), (stage, key, s[key], l[key])


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_does_not_grow_from_step_to_step(stage):
    """M_D: long-lived tensors sit in arenas allocated once, temporaries reuse fixed buffers, so
    after warm-up neither the live tensor bytes nor the process RSS grow. In process (SoloGroup)."""
    cfg = gpt.GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64)
    batches = gpt.CharBatches(8, cfg.seq_len, 50, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # the census below then walks only objects created from here on
    try:
        engine = Engine(functools.partial(gpt.GPT, cfg), gpt.gpt_loss, zr.AdamW(lr=1e-3),
                        zr.ZeroConfig(stage=stage, bucket_bytes=BUCKET_BYTES), SoloGroup())
        seen = {}
        for step, batch in enumerate(batches, start=1):
            engine.train_step(batch)
            if step in (5, 50):
                seen[step] = (_rss_bytes(), live_tensor_bytes())
        engine.close()
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    (rss5, live5), (rss50, live50) = seen[5], seen[50]
    assert live50 == live5, (live5, live50)
    assert abs(rss50 - rss5) <= 0.02 * rss5, (rss5, rss50)
