"""``nn.SyncBatchNorm`` and torch.distributed inside the user's code, engine level, in plain
torch gloo processes ([Note: SyncBatchNorm on CPU] in zeroray/engine/sync_batchnorm.py,
[Note: torch.distributed in user code] in zeroray/comm/user_group.py).

A SyncBatchNorm normalises every worker's rows with the mean and variance of the whole global
batch, so a SyncBatchNorm model trained by zeroray equals single-process PyTorch training the
same model with plain BatchNorm on the global batches (what torch DDP with SyncBatchNorm
computes): losses, parameters and running statistics, at every stage, on 2 and 3 workers. torch
DDP cannot run SyncBatchNorm on CPU (its forward refuses a CPU input, shown below), so the DDP
reference synchronises with a module written to be obviously right (tests/batchnorm_models.py:
gather every rank's rows, ``F.batch_norm`` on all of them, keep its own), and zeroray equals it.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import zeroray as zr
from tests.batchnorm_models import (class_loss, conv_bn, feature_batches, image_batches, mlp_bn, sync_conv_bn,
                                    sync_mlp_bn, with_gather_batchnorm)
from tests.dist.harness import gloo_world, load_ranks, run_engine_table, spawn_ranks
from tests.dist.test_engine_parity import assert_parity, global_losses
from tests.models import reference_run
from zeroray.comm.port import free_port
from zeroray.engine.batch import split_batch

STEPS = 4
ADAMW = dict(lr=1e-2, weight_decay=0.1)
WORLDS = (2, 3)
# name -> (plain BatchNorm model, the same converted by convert_sync_batchnorm, batches)
MODELS = {"conv": (conv_bn, sync_conv_bn, image_batches(STEPS)), "mlp": (mlp_bn, sync_mlp_bn, feature_batches(STEPS))}


def ref_adamw(model):
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def _inspect(engine):
    """Each rank's buffers after training, and what torch.distributed told it."""
    return {"buffers": {n: b.detach().clone() for n, b in engine.model.named_buffers()},
            "dtypes": {n: b.dtype for n, b in engine.model.named_buffers()},
            "dist": (dist.get_rank(), dist.get_world_size())}


def _spec(model_fn, batches, stage, **zero):
    return dict(model_fn=model_fn, loss_fn=class_loss, optimizer=zr.AdamW(**ADAMW),
                zero=zr.ZeroConfig(stage=stage, **zero), batches=batches, inspect=_inspect)


class OwnGroupBN(nn.Module):
    """A SyncBatchNorm over a process group of this rank alone, made in model_fn from the
    default group: it must normalise each rank's rows by themselves, as plain BatchNorm does."""

    def __init__(self) -> None:
        super().__init__()
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
        self.net = nn.SyncBatchNorm.convert_sync_batchnorm(conv_bn(), process_group=groups[dist.get_rank()])

    def forward(self, x):
        return self.net(x)


class PlainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = conv_bn()

    def forward(self, x):
        return self.net(x)


class UserCollectivesNet(nn.Module):
    """Blocks in a ModuleList (stage 3 prefetches the next blocks' units while one computes),
    with the user's own collectives between them: an all_reduce of the row count, whose value
    scales the activations by exactly 1, and of a detached activation statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(6, 5)
        self.seen = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if dist.is_initialized():
                rows = torch.tensor([float(x.shape[0])])
                dist.all_reduce(rows)
                stat = x.detach().mean(0)
                dist.all_reduce(stat)
                self.seen.append((rows.item(), dist.get_world_size()))
                x = x * (rows.item() / (x.shape[0] * dist.get_world_size()))
        return self.head(x)


def user_collectives_loss(model, batch):
    x, y = batch
    loss = class_loss(model, batch)
    if dist.is_initialized():  # a metric reduced in loss_fn, after the forward, beside backward's gathers
        total = loss.detach().clone()
        dist.all_reduce(total)
        model.seen.append((float(x.shape[0]), dist.get_world_size()))
    return loss


def _seen(engine):
    return list(engine.model.seen)


@pytest.fixture(scope="module")
def runs():
    table = {}
    for name, (_, sync_fn, batches) in MODELS.items():
        for world in WORLDS:
            for stage in range(4):
                table[(name, stage, world)] = (world, _spec(sync_fn, batches, stage))
        # the same model with plain BatchNorm: each worker normalises its own rows
        table[(name, "plain", 2)] = (2, _spec(MODELS[name][0], batches, 0))
    table[("conv", "bf16", 2)] = (2, _spec(sync_conv_bn, MODELS["conv"][2], 3, dtype="bf16"))
    table[("own-group", 2)] = (2, _spec(OwnGroupBN, MODELS["conv"][2], 3))
    table[("plain-net", 2)] = (2, _spec(PlainNet, MODELS["conv"][2], 3))
    table[("collectives", 3)] = (3, dict(_spec(UserCollectivesNet, feature_batches(STEPS), 3),
                                         loss_fn=user_collectives_loss, inspect=_seen))
    return run_engine_table(table)


@pytest.fixture(scope="module")
def references():
    return {name: reference_run(plain_fn, class_loss, ref_adamw, batches)
            for name, (plain_fn, _, batches) in MODELS.items()}


def _diffs(ref, results, params):
    losses, _, state = ref
    loss = max(abs(a - b) / abs(b) for a, b in zip(global_losses(results), losses))
    worst = {"params": 0.0, "buffers": 0.0}
    for name, want in state.items():
        kind = "buffers" if name in results[0]["untrained"] else "params"
        got = params[name].reshape(want.shape).to(want.dtype)
        worst[kind] = max(worst[kind], (got.double() - want.double()).abs().max().item())
    return loss, worst["params"], worst["buffers"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_sync_batchnorm_equals_single_process_batchnorm_on_the_global_batch(runs, references, name, world):
    """Losses, parameters and running statistics (num_batches_tracked included) of every stage
    equal single-process plain BatchNorm on the global batches, to the parity tolerances; every
    rank holds the same running statistics (they come from the same global sums)."""
    for stage in range(4):
        results, params = runs[(name, stage, world)]
        where = f"{name}, stage {stage}, {world} workers"
        try:
            assert_parity(references[name], results, params)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        for r, res in enumerate(results):
            assert res["inspect"]["dist"] == (r, world), where  # torch.distributed's rank and size
            for key, value in res["inspect"]["buffers"].items():
                assert torch.equal(value, results[0]["inspect"]["buffers"][key]), f"{where}: rank {r}'s {key}"
        loss, par, buf = _diffs(references[name], results, params)
        print(f"{where}: vs single process loss rel {loss:.1e}, params {par:.1e}, running stats {buf:.1e}")
    # The test can tell: plain BatchNorm (each worker's own rows) trains another model.
    loss, par, buf = _diffs(references[name], *runs[(name, "plain", 2)])
    assert loss > 1e-4 and par > 1e-3 and buf > 1e-3, (loss, par, buf)


def _ddp_rank(rank, world, port, cases, out_dir):
    gloo_world(rank, world, port)
    kept = []  # alive until the rank exits (harness._run_rank)
    for name, plain_fn, batches in cases:
        torch.manual_seed(0)
        model = with_gather_batchnorm(plain_fn())
        ddp = DistributedDataParallel(model)
        kept.append(ddp)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        losses = []
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            loss = class_loss(ddp, split_batch(batch, world)[rank])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   os.path.join(out_dir, f"{name}_rank{rank}.pt"))


def ddp_runs(world):
    cases = [(name, plain_fn, batches) for name, (plain_fn, _, batches) in MODELS.items()]
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_ddp_rank, world, (world, free_port(), cases), out_dir, join_s=300)
        return {name: load_ranks(out_dir, name, world) for name in MODELS}


@pytest.mark.parametrize("world", WORLDS)
def test_equals_torch_ddp_with_a_synchronised_batchnorm(runs, references, world):
    """torch DDP over gloo with the gathering BatchNorm equals single-process BatchNorm on the
    global batch, and zeroray's SyncBatchNorm at every stage equals that DDP."""
    ddp = ddp_runs(world)
    for name in MODELS:
        ranks = ddp[name]
        ddp_losses = [sum(r["losses"][i] for r in ranks) / world for i in range(STEPS)]
        ref_losses, _, ref_state = references[name]
        for step, (a, b) in enumerate(zip(ddp_losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name}: step {step}: DDP {a} vs single process {b}"
        for r in range(world):
            for key, want in ref_state.items():
                err = (ranks[r]["state"][key].double() - want.double()).abs().max().item()
                assert err <= 1e-5, f"{name}: DDP rank {r}'s {key} vs single process: {err:.2e}"
        for stage in range(4):
            results, params = runs[(name, stage, world)]
            loss = max(abs(a - b) / abs(b) for a, b in zip(global_losses(results), ddp_losses))
            assert loss <= 1e-5, f"{name}, stage {stage}: loss vs DDP {loss:.2e}"
            worst = {"params": 0.0, "buffers": 0.0}
            for key, want in ranks[0]["state"].items():
                kind = "buffers" if key in results[0]["untrained"] else "params"
                err = (params[key].reshape(want.shape).double() - want.double()).abs().max().item()
                assert err <= 1e-5, f"{name}, stage {stage}: {key} vs DDP: {err:.2e}"
                worst[kind] = max(worst[kind], err)
            print(f"{name}, stage {stage}, {world} workers: zeroray vs torch DDP (gathering BatchNorm): loss rel "
                  f"{loss:.1e}, params {worst['params']:.1e}, running stats {worst['buffers']:.1e}")


def _refusal_rank(rank, world, port, out_dir):
    gloo_world(rank, world, port)
    torch.manual_seed(0)
    model = sync_conv_bn()
    try:
        DistributedDataParallel(model)
        wrapped = "wrapped"
    except ValueError as e:
        wrapped = str(e)
    x = image_batches(1)[0][0][:4]
    try:
        model(x)
        trained = "ran"
    except ValueError as e:
        trained = str(e)
    model.eval()
    with torch.no_grad():
        evaluated = model(x).shape  # eval mode does not synchronise: it runs
    torch.save({"wrapped": wrapped, "trained": trained, "evaluated": tuple(evaluated)},
               os.path.join(out_dir, f"refusal_rank{rank}.pt"))


def test_torch_refuses_sync_batchnorm_on_cpu():
    """What the README says of torch's own SyncBatchNorm on CPU: torch DDP refuses to wrap a model
    with one, and once torch.distributed is initialised its training forward refuses a CPU input
    (eval mode runs: it does not synchronise); without torch.distributed it runs as a plain
    BatchNorm, which is what it did on zeroray's workers before they had a default group."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_refusal_rank, 2, (2, free_port()), out_dir, join_s=120)
        seen = load_ranks(out_dir, "refusal", 2)
    for r in seen:
        assert "SyncBatchNorm layers only work with GPU modules" in r["wrapped"], r["wrapped"]
        assert "expected input tensor to be on GPU" in r["trained"], r["trained"]
        assert r["evaluated"] == (4, 5)
    print(f"torch DDP(model with SyncBatchNorm) on CPU: {seen[0]['wrapped']!r}; its forward: {seen[0]['trained']!r}")
    assert not dist.is_initialized()
    torch.manual_seed(0)
    sync = sync_conv_bn()
    torch.manual_seed(0)
    plain = conv_bn()
    x = image_batches(1)[0][0]
    assert torch.equal(sync(x), plain(x))
    assert torch.equal(sync.features[1].running_mean, plain.features[1].running_mean)


def test_process_group_of_the_module_is_honoured(runs):
    """A SyncBatchNorm whose process_group holds this rank alone (made in model_fn with
    dist.new_group) normalises each rank's rows by themselves: bit for bit what plain BatchNorm
    gives, and not what the whole-group sync gives."""
    own, _ = runs[("own-group", 2)]
    plain, _ = runs[("plain-net", 2)]
    synced, _ = runs[("conv", 3, 2)]
    assert [r["losses"] for r in own] == [r["losses"] for r in plain]
    for a, b in zip(own, plain):
        for key, value in a["inspect"]["buffers"].items():
            assert torch.equal(value, b["inspect"]["buffers"][key]), key
    assert abs(global_losses(own)[-1] - global_losses(synced)[-1]) > 1e-4


def test_sync_batchnorm_in_bf16_computes_in_fp32(runs, references):
    """Mixed precision keeps a SyncBatchNorm in fp32 as it keeps every _BatchNorm ([Note: mixed
    precision]): fp32 running statistics, the same on every rank (synchronised), and bf16
    training within the 3% of fp32 that the other mixed-precision tests allow."""
    results, _ = runs[("conv", "bf16", 2)]
    ref_losses = references["conv"][0]
    for r in results:
        assert {d for n, d in r["inspect"]["dtypes"].items() if "running" in n} == {torch.float32}
        for key, value in r["inspect"]["buffers"].items():
            assert torch.equal(value, results[0]["inspect"]["buffers"][key]), key
    for step, (a, b) in enumerate(zip(global_losses(results), ref_losses)):
        assert abs(a - b) <= 0.03 * abs(b), f"step {step}: bf16 {a} vs fp32 {b}"


def test_user_collectives_at_stage_3_beside_prefetched_gathers(runs):
    """The user's all_reduces between blocks of the forward and in loss_fn (stage 3, 3 workers,
    while the next blocks' units are being gathered) neither hang nor change the step: losses
    and parameters as single-process PyTorch, the reduced values right, prefetch in use."""
    results, params = runs[("collectives", 3)]
    ref = reference_run(UserCollectivesNet, class_loss, ref_adamw, feature_batches(STEPS))
    assert_parity(ref, results, params)
    for r in results:
        assert r["inspect"] and all(seen == (12.0, 3) or seen == (4.0, 3) for seen in r["inspect"]), r["inspect"]
    fetch = results[0]["reports"][-1]["fetch"]
    assert fetch["prefetch_hits"] > 0 and fetch["rounds"] == 0, fetch
