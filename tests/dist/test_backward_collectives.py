"""A backward that issues collectives (SyncBatchNorm) beside a layer one rank leaves unused, with
small gradient buckets: the step finishes and equals single-process PyTorch and torch DDP
([Note: no wait in backward] in zeroray/comm/buckets.py).

The fuzzer's seed 7700464 hung here (stage 0, 3 workers, 40-byte buckets): the rank whose rows
ran the expert launched the expert's bucket and then, out of buffers, waited for it inside
backward; the others launch it only at the end of backward (no gradient of it came), and were
held first in SyncBatchNorm's backward all_reduce, waiting for the blocked rank. Collectives
here time out after ``TIMEOUT_S``, so a hang fails the test instead of stalling it.

torch DDP cannot run SyncBatchNorm on CPU (tests/dist/test_sync_batchnorm.py), so its run
synchronises with the gathering BatchNorm (tests/batchnorm_models.py), whose backward issues a
collective too, with ``find_unused_parameters=True`` and 40-byte buckets: DDP's reducer never
waits in backward, and finishes.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroray as zr
from tests.batchnorm_models import with_gather_batchnorm
from tests.dist.ddp_run import ddp_spec, fused_adamw
from tests.dist.harness import run_engine_table
from tests.dist.parity import assert_parity
from tests.models import reference_run

STEPS = 3
ROWS = 12  # the global batch: 2 and 3 workers split it evenly
ADAMW = dict(lr=1e-2, weight_decay=0.1)
BUCKET_BYTES = 40  # a few elements per bucket: the pool runs out of buffers within backward
TIMEOUT_S = 60
CASES = [(2, 0), (3, 0), (3, 2), (3, 3)]  # (workers, stage)


class GatedNet(nn.Module):
    """A (Sync)BatchNorm, then an expert that only the rows with a positive first column run:
    its gradients arrive in backward before the BatchNorm's, on the ranks whose rows ran it."""

    def __init__(self, sync: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8, bias=False)
        self.bn = nn.SyncBatchNorm(8) if sync else nn.BatchNorm1d(8)
        self.mid = nn.Linear(8, 8)
        self.expert = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(F.relu(self.bn(self.fc(x))))
        rows = (x[:, 0] > 0).nonzero().flatten()
        if rows.numel():  # data-dependent: a rank with no such row leaves the expert unused
            h = h.index_add(0, rows, torch.tanh(self.expert(h[rows])))
        return self.head(h)


def sync_net() -> nn.Module:
    return GatedNet(sync=True)


def plain_net() -> nn.Module:
    return GatedNet(sync=False)


def gather_net() -> nn.Module:
    return with_gather_batchnorm(GatedNet(sync=False))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def gated_batches(world: int, every_rank: bool = False):
    """Step 0: only rank 0's rows run the expert; step 1: only the last rank's; step 2: all
    (``every_rank``: every step as step 2)."""
    g = torch.Generator().manual_seed(0)
    share, out = ROWS // world, []
    for step in range(STEPS):
        x = torch.randn(ROWS, 6, generator=g)
        sign = torch.ones(ROWS)
        if step == 0 and not every_rank:
            sign[share:] = -1
        elif step == 1 and not every_rank:
            sign[:ROWS - share] = -1
        x[:, 0] = (x[:, 0].abs() + 0.1) * sign
        out.append((x, torch.randint(0, 5, (ROWS,), generator=g)))
    return out


def _no_wait(engine):
    return engine.reducer.backward_collectives


def _spec(model_fn, world, stage, every_rank=False):
    return dict(model_fn=model_fn, loss_fn=loss_fn, optimizer=zr.AdamW(**ADAMW),
                batches=gated_batches(world, every_rank), zero=zr.ZeroConfig(stage=stage, bucket_bytes=BUCKET_BYTES),
                timeout_s=TIMEOUT_S, inspect=_no_wait)


@pytest.fixture(scope="module")
def runs():
    table = {("sync", world, stage): (world, _spec(sync_net, world, stage)) for world, stage in CASES}
    # no collectives in backward, every rank running every layer: the pool waits, within its bound
    table[("plain", 2, 0)] = (2, _spec(plain_net, 2, 0, every_rank=True))
    for world in sorted({w for w, _ in CASES}):
        table[("ddp", world)] = (world, ddp_spec(
            model_fn=gather_net, loss_fn=loss_fn, optimizer=fused_adamw(**ADAMW), batches=gated_batches(world),
            ddp_options=dict(find_unused_parameters=True, bucket_cap_mb=BUCKET_BYTES / 2 ** 20)))
    return run_engine_table(table)


def _reference(world):
    return reference_run(plain_net, loss_fn, lambda m: torch.optim.AdamW(m.parameters(), **ADAMW),
                         gated_batches(world))


@pytest.mark.parametrize("world,stage", CASES)
def test_sync_batchnorm_beside_a_layer_one_rank_leaves_unused_trains_as_pytorch(runs, world, stage):
    """Finishes (before the fix: the collective timeout) and equals single-process BatchNorm on
    the global batch, within the bound torch DDP sets on the same batches."""
    results, params = runs[("sync", world, stage)]
    assert_parity(_reference(world), results, params, ddp=runs[("ddp", world)])


@pytest.mark.parametrize("world", sorted({w for w, _ in CASES}))
def test_torch_ddp_finishes_with_a_collective_in_backward_and_tiny_buckets(runs, world):
    """torch DDP on the same model and data (the gathering BatchNorm, find_unused_parameters,
    40-byte buckets) finishes and equals single-process PyTorch to float reordering."""
    ddp, _ = runs[("ddp", world)]
    losses, _, state = _reference(world)
    got = [sum(r["losses"][i] for r in ddp) / world for i in range(STEPS)]
    for step, (a, b) in enumerate(zip(got, losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: DDP {a} vs single process {b}"
    for key, want in state.items():
        err = (ddp[0]["state"][key].double() - want.double()).abs().max().item()
        assert err <= 1e-5, f"DDP's {key} vs single process: {err:.2e}"


def test_the_pool_grows_only_where_backward_has_collectives(runs):
    """Step 0, only rank 0's rows run the expert: rank 0 launches the expert's bucket, which its
    peers launch only at the end of backward, so it cannot complete before rank 0 passes
    SyncBatchNorm's backward; the next bucket's buffer is a new one, past the bound (the
    no-wait path really ran). A model without collectives in backward waits as before: with
    every rank running every layer, two buffers (one reduction in flight, one bucket filling)."""
    bound = 2
    results = runs[("plain", 2, 0)][0]
    for r, res in enumerate(results):
        assert res["inspect"] is False, f"plain, rank {r}"
        assert [rep["bucket_pool"] for rep in res["reports"]] == [bound] * STEPS, f"plain, rank {r}"
    for world, stage in CASES:
        results = runs[("sync", world, stage)][0]
        assert all(res["inspect"] is True for res in results), (world, stage)
        if stage < 3:  # stage 3's pool follows its fetch rounds as well: the parity test covers it
            first = results[0]["reports"][0]["bucket_pool"]
            assert first > bound, f"{world} workers, stage {stage}: rank 0's pool {first} after step 0"
