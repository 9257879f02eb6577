"""Exact parity with the planned flush timeout and "auto" bucket sizes (issue 20), in plain
torch gloo processes: the plan changes how gradients are grouped into buckets, between
steps and identically on every rank, never their values ([Note: bucket timeout])."""
import time

import pytest
import torch
import torch.nn as nn

import zeroray as zr
from tests.dist.harness import run_engine_table
from tests.dist.test_engine_parity import ADAMW, assert_parity, ref_adamw
from tests.models import (VOCAB, divergent_batches, divergent_model, lm_loss, make_batches, per_shard_loss,
                          reference_run)

STEPS = 6
PAUSE_S = 0.02   # between two blocks' gradients: far above the timeouts below
WIDTH = 48


class _Pause(torch.autograd.Function):
    """Identity; its backward sleeps, so the gradients of the layers before it arrive late."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(PAUSE_S)
        return grad


class PausedNet(nn.Module):
    """Gradients arrive in bursts: head | block 3 | block 2 | block 1 | block 0 with the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = _Pause.apply(torch.tanh(block(x)))
        return self.head(x)


def paused_model() -> nn.Module:
    return PausedNet()


CASES = {  # name: (stage, ZeroConfig overrides)
    "stage3-timeout": (3, dict(bucket_timeout_ms=5.0)),
    "stage3-auto": (3, dict(bucket_bytes="auto")),
    "stage2-auto-accum": (2, dict(bucket_bytes="auto", bucket_timeout_ms=5.0, grad_accum_steps=2)),
    "stage1-timeout-small": (1, dict(bucket_bytes=4096, bucket_timeout_ms=5.0)),  # pieces of units, too
    "stage0-auto": (0, dict(bucket_bytes="auto", bucket_timeout_ms=5.0)),
}


WORLDS = (2, 3)


def _specs(world):
    """name -> spec of one world size: the CASES and a divergent stage-3 run."""
    batches = make_batches(STEPS)
    specs = {name: dict(model_fn=paused_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                        zero=zr.ZeroConfig(stage=stage, **zero), batches=batches)
             for name, (stage, zero) in CASES.items()}
    # Ranks that take different branches (negotiated stage-3 steps) after two steps that agree:
    # the plan learned from those two is followed, and nothing is learned from the negotiated ones.
    specs["stage3-divergent"] = dict(
        model_fn=divergent_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
        zero=zr.ZeroConfig(stage=3, wrap="module", bucket_bytes="auto", bucket_timeout_ms=0.05),
        batches=divergent_batches(STEPS, agree_first=2, world=world, batch=4 * world))
    return specs


@pytest.fixture(scope="module")
def runs():
    """Both world sizes in one set of 3 processes (start-up dominates): (world, name) -> run."""
    return run_engine_table({(world, name): (world, spec) for world in WORLDS for name, spec in _specs(world).items()})


@pytest.mark.parametrize("world", WORLDS)
def test_parity_with_the_timeout_and_auto_sizes(runs, world):
    batches = make_batches(STEPS)
    ref = reference_run(paused_model, lm_loss, ref_adamw, batches)
    divergent = _specs(world)["stage3-divergent"]["batches"]
    for name in list(CASES) + ["stage3-divergent"]:
        results, params = runs[(world, name)]
        try:
            if name == "stage3-divergent":
                assert_parity(reference_run(divergent_model, per_shard_loss(lm_loss, world), ref_adamw, divergent),
                              results, params)
            else:
                assert_parity(ref, results, params)
            check_plan(name, [[rep["buckets"] for rep in r["reports"]] for r in results])
        except AssertionError as e:
            raise AssertionError(f"{name}, {world} workers: {e}") from None


def check_plan(name, per_rank):
    """``per_rank[r][step]``: rank r's bucket_stats() after each step."""
    launched = [[s["buckets_full"] + s["buckets_timeout"] + s["buckets_end"] for s in steps] for steps in per_rank]
    sizes = [[s["bucket_bytes"] for s in steps] for steps in per_rank]
    # Every rank follows the same plan: as many reductions, from buckets of the same size.
    assert all(x == launched[0] for x in launched), launched
    assert all(x == sizes[0] for x in sizes), sizes
    stats = per_rank[0]
    if name == "stage3-divergent":
        return
    micro = 2 if "accum" in name else 1
    # Learned after the second step, so the third is the first that follows a plan; from then
    # on, each of the four pauses ends a bucket by the timeout.
    assert stats[0]["buckets_timeout"] == 0, stats[0]
    assert all(s["buckets_timeout"] >= 3 * micro for s in stats[3:]), stats
    if "small" in name:
        assert all(s["buckets_full"] > 0 for s in stats), stats  # 4 KiB: full buckets as well
    if "auto" in name:
        # 16 MiB to the smallest size, which holds the largest burst, after the second step.
        assert [s["bucket_bytes"] for s in stats] == [16 * 2**20] * 2 + [64 * 2**10] * (STEPS - 2), stats
        assert stats[-1]["bucket_size_changes"] == [[2, 16 * 2**20, 64 * 2**10]], stats[-1]
        assert stats[-1]["bucket_first_wait_ms"] < stats[0]["bucket_first_wait_ms"], stats
