"""torch.distributed inside the user's code on real Ray workers ([Note: torch.distributed in user
code] in zeroray/comm/user_group.py): ``get_rank``, ``get_world_size`` and ``all_reduce`` in
``model_fn``, ``loss_fn``, ``metric_fn`` and ``trainer.run(fn)``, on a group that follows
``resize`` (3 workers, then 1) and a recovery (a worker SIGKILLed mid-fit, replaced by a warm
spare, the snapshot loaded).

The recovery runs a BatchNorm model (plain, each worker's statistics from its own rows) and
evaluates after the fit: with the buffers broadcast from rank 0 ([Note: buffers follow DDP] in
zeroray/engine/buffer_sync.py) the recovered run's evaluation equals the uninterrupted run's bit
for bit, as its losses and weights do.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroray as zr
from tests.batchnorm_models import class_loss, conv_bn, image_batches
from tests.models import lm_loss, make_batches, parity_model
from tests.ray.test_faults import KillingData, gated_loss
from tests.ray.test_snapshot_recovery import _arm_kill
from tests.ray.user_dist import check_group, dist_view


class Probe(nn.Module):
    """ParityNet, built by a model_fn that asks torch.distributed who it is and reduces across ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = parity_model()
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        self.built = (dist.get_rank(), dist.get_world_size(), total.item())
        self.calls = []  # (rank, world size, all_reduce of ones) per loss_fn call

    def forward(self, idx):
        return self.net(idx)


def probe_loss(model, batch):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    model.calls.append((dist.get_rank(), dist.get_world_size(), ones.item()))
    return lm_loss(model, batch)


def probe_metric(model, batch):
    rows = torch.tensor([float(batch[0].shape[0])])
    dist.all_reduce(rows)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "global_rows": rows.item()}


def test_torch_distributed_in_user_code_follows_resize(ray_local):
    batches = make_batches(3)
    with zr.Trainer(Probe, probe_loss, optimizer=zr.AdamW(lr=1e-2), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(batches[0])
        views = trainer.run(dist_view)
        check_group(views, 2)
        assert [v["built"] for v in views] == [(0, 2, 3.0), (1, 2, 3.0)]  # model_fn saw the group
        assert [v["calls"] for v in views] == [[(0, 2, 2.0)], [(1, 2, 2.0)]]  # loss_fn too
        metrics = trainer.evaluate(batches[:1], metric_fn=probe_metric)
        assert (metrics["rank"], metrics["world"], metrics["global_rows"]) == (0.5, 2.0, 12.0), metrics

        trainer.resize(3)
        trainer.step(batches[1])
        views = trainer.run(dist_view)
        check_group(views, 3)
        assert [v["built"] for v in views] == [(r, 3, 6.0) for r in range(3)]
        assert [v["calls"] for v in views] == [[(r, 3, 3.0)] for r in range(3)]
        metrics = trainer.evaluate(batches[:1], metric_fn=probe_metric)
        assert (metrics["rank"], metrics["world"], metrics["global_rows"]) == (1.0, 3.0, 12.0), metrics

        trainer.resize(1)  # zeroray's own group is a SoloGroup: torch.distributed still has one
        trainer.step(batches[2])
        views = trainer.run(dist_view)
        check_group(views, 1)
        assert views[0]["built"] == (0, 1, 1.0) and views[0]["calls"] == [(0, 1, 1.0)]
        assert trainer.evaluate(batches[:1], metric_fn=probe_metric)["global_rows"] == 12.0


def reducing_class_loss(model, batch):
    """class_loss, with the user's all_reduce of the row count: every worker's rows counted."""
    rows = torch.tensor([float(batch[0].shape[0])])
    dist.all_reduce(rows)
    assert rows.item() == 12.0, rows
    return class_loss(model, batch)


STEPS, KILL_AT = 6, 3


def _bn_trainer(gate_dir, ckpt_dir, spares):
    return zr.Trainer(conv_bn, functools.partial(gated_loss, str(gate_dir), inner=reducing_class_loss),
                      optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=3, collective_timeout_s=10.0), scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=2, snapshot_every=1, spares=spares),
                      checkpoint=zr.CheckpointConfig(path=str(ckpt_dir)))


def test_recovery_rejoins_the_group_and_evaluates_bitwise(ray_local, tmp_path):
    batches, evals = image_batches(STEPS, seed=5), image_batches(2, seed=6)
    gate = tmp_path / "gate"
    gate.mkdir()
    with _bn_trainer(gate, tmp_path / "ref_ckpt", 0) as trainer:  # uninterrupted
        ref = trainer.fit(batches, progress=False)
        ref_eval = trainer.evaluate(evals)
        ref_state = trainer.state_dict()

    with _bn_trainer(gate, tmp_path / "ckpt", 1) as trainer:
        trainer.save()
        before = trainer.run(dist_view)
        arm, landed, target = _arm_kill(trainer, gate, batches[KILL_AT])
        results = trainer.fit(KillingData(batches, KILL_AT, arm), progress=False)
        assert landed == {"batch": target}, landed
        rec = trainer.recoveries[-1]
        assert rec["restored_from"] == "memory" and rec["spares_used"] == 1, rec
        views = trainer.run(dist_view)
        evaluation = trainer.evaluate(evals)
        state = trainer.state_dict()
    check_group(views, 2)
    assert views[0]["pid"] == before[0]["pid"] and views[1]["pid"] != before[1]["pid"]  # rank 1 is the spare
    assert [r.loss for r in results] == [r.loss for r in ref]  # bitwise
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    assert evaluation == ref_eval, (evaluation, ref_eval)  # bitwise: every worker evaluates with rank 0's buffers
    print(f"\n  recovered (spare) at step {rec['step']}: evaluate {evaluation} == uninterrupted {ref_eval}")
