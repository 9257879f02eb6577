"""Errors raised on a worker reach the user as their own type, message first, naming the worker,
with the worker's traceback as the cause; a step that fails on one worker leaves the group usable.

[Note: worker errors on the driver] in zeroray/runtime/failures.py; the step outcome protocol in
zeroray/errors.py. The every-worker case (all ranks raise in loss_fn) is in test_pipeline.py.
"""
import pytest
import ray
import torch

import zeroray as zr
from tests.models import VOCAB, lm_loss, make_batches, parity_model, reference_run
from zeroray.checkpoint import CheckpointError
from zeroray.runtime.failures import WorkerTraceback

RAISE_MARK = VOCAB - 3
OPT = dict(lr=1e-2, weight_decay=0.1)


def one_rank_raises(model, batch):
    idx, _ = batch
    if bool((idx == RAISE_MARK).all()):
        raise KeyError("labels")  # a bug in user code, on the worker whose whole share is marked
    return lm_loss(model, batch)


def test_a_damaged_shard_is_the_checkpoints_own_error_from_the_worker_that_read_it(ray_local, tmp_path):
    root = tmp_path / "ckpt"
    with zr.Trainer(parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(make_batches(1)[0])
        step_dir = trainer.save(str(root))
    shard = root / "step_00000001" / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(data)
    with pytest.raises(CheckpointError) as info:
        zr.Trainer.restore(step_dir, parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2))
    error = info.value
    print(f"\n  {type(error).__name__}: {error}\n  notes: {error.__notes__}")
    assert type(error) is CheckpointError and not isinstance(error, ray.exceptions.RayTaskError)
    assert str(error).startswith(str(shard)) and "is corrupted: sha256" in str(error)
    assert any(n.startswith("zeroray: raised on worker 1 (pid ") and "during restore" in n for n in error.__notes__)
    assert isinstance(error.__cause__, WorkerTraceback) and "load_resharded" in str(error.__cause__)


def test_one_workers_error_is_raised_and_the_next_step_works(ray_local):
    batches = make_batches(3)
    idx, tgt = batches[1]
    marked = (torch.cat([idx[:6], torch.full_like(idx[6:], RAISE_MARK)]), tgt)  # worker 1's share
    with zr.Trainer(parity_model, one_rank_raises, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(batches[0])
        pids = [w["pid"] for w in trainer.workers]
        with pytest.raises(KeyError) as info:
            trainer.step(marked)
        error = info.value
        # Worker 1's own error, not worker 0's PeerStepError; the group was not torn down.
        assert type(error) is KeyError and str(error) == "'labels'"
        assert any(n.startswith("zeroray: raised on worker 1 (pid ") for n in error.__notes__), error.__notes__
        assert isinstance(error.__cause__, WorkerTraceback)
        assert [w["pid"] for w in trainer.workers] == pids and trainer.step_count == 1
        results = [trainer.step(b) for b in batches[1:]]
        assert [r.step for r in results] == [2, 3]
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)  # noqa: E731
    want = reference_run(parity_model, lm_loss, make_opt, batches)[0]
    assert [r.loss for r in results] == pytest.approx(want[1:], rel=1e-5)
