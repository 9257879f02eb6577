"""Ray Data recovery replays the same rows ([Note: Ray Data replay] in zeroray/runtime/fit/data.py).

The dataset goes through a ``map_batches`` whose tasks take random times, so its blocks finish
out of order on every pass. One fit runs uninterrupted; another, with checkpoints every 2 steps,
loses worker 1 (SIGKILL) inside step 6, recovers from the checkpoint of step 4 and replays from
there. Every worker records the row ids of each local batch it trained on: after the recovery,
steps 5-8 see exactly the rows they saw in the uninterrupted run, rank by rank, and the final
weights are equal.

The kill lands inside a known step whatever the machine's load: worker 1 blocks in ``loss_fn``
on the batch whose ids the gate names (its rows of step 6 in the uninterrupted run), says so,
and only then is killed.
"""
import functools
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch

import zeroray as zr
from tests.models import SEQ, VOCAB, lm_loss, parity_model

ROWS, GLOBAL, WORKERS, EVERY = 64, 8, 2, 2
STEPS = ROWS // GLOBAL
KILL_STEP = 6  # 1-based: worker 1 dies inside the sixth step; the last checkpoint is step 4


def _jitter(batch):
    time.sleep(random.random() * 0.05)  # blocks finish in a different order on every pass
    return batch


def _dataset():
    import ray.data

    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    items = [{"id": i, "idx": idx[i].numpy(), "tgt": tgt[i].numpy()} for i in range(ROWS)]
    return ray.data.from_items(items, override_num_blocks=16).map_batches(_jitter, batch_size=None)


def recording_loss(log_dir, model, batch):
    """Record this local batch's row ids (one line per step, a file per process); block here if the
    gate names this process and these rows."""
    ids = " ".join(str(i) for i in batch["id"].tolist())
    with open(os.path.join(log_dir, f"{os.getpid()}.ids"), "a") as f:
        f.write(ids + "\n")
    gate = os.path.join(log_dir, "gate")
    if os.path.exists(gate) and open(gate).read() == f"{os.getpid()}:{ids}":
        open(os.path.join(log_dir, "blocked"), "w").close()
        time.sleep(300)  # the test SIGKILLs this process long before
    return lm_loss(model, (batch["idx"], batch["tgt"]))


def wait_for(condition, what, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _rows(log_dir, pid):
    with open(os.path.join(log_dir, f"{pid}.ids")) as f:
        return [line.split() for line in f]


def _trainer(log_dir, **kwargs):
    return zr.Trainer(parity_model, functools.partial(recording_loss, str(log_dir)),
                      optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1), zero=zr.ZeroConfig(stage=3),
                      scaling=zr.ScalingConfig(num_workers=WORKERS), **kwargs)


def test_recovery_mid_fit_on_a_dataset_replays_the_same_rows(ray_local, tmp_path):
    plain, chaos = tmp_path / "plain", tmp_path / "chaos"
    plain.mkdir()
    chaos.mkdir()
    with _trainer(plain) as trainer:
        trainer.fit(_dataset(), batch_size=GLOBAL, progress=False)
        want_state = trainer.state_dict()
        want = [_rows(plain, w["pid"]) for w in trainer.workers]  # per rank, per step
    assert all(len(rows) == STEPS for rows in want)

    with _trainer(chaos, failure=zr.FailureConfig(max_failures=1),
                  checkpoint=zr.CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=EVERY)) as trainer:
        pid = trainer.workers[1]["pid"]
        (chaos / "gate").write_text(f"{pid}:{' '.join(want[1][KILL_STEP - 1])}")

        def killer():
            wait_for((chaos / "blocked").exists, "worker 1 to block in its step-6 batch")
            os.kill(pid, signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
        results = trainer.fit(_dataset(), batch_size=GLOBAL, progress=False)
        assert trainer.step_count == STEPS and [r.step for r in results][-4:] == [5, 6, 7, 8]
        assert len(trainer.recoveries) == 1 and trainer.recoveries[0]["step"] == KILL_STEP - 2
        state = trainer.state_dict()
        replayed = [_rows(chaos, w["pid"]) for w in trainer.workers]
    print(f"\n  rows of step {KILL_STEP}, worker 1: {want[1][KILL_STEP - 1]}; after the recovery: {replayed[1][1]}")
    # The new group trained steps 5-8: rank by rank, the rows of the uninterrupted run.
    for rank in range(WORKERS):
        assert replayed[rank] == want[rank][KILL_STEP - 2:], rank
    worst = max((state[k] - v).abs().max().item() for k, v in want_state.items())
    assert worst <= 1e-6, worst
