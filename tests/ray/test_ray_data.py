"""fit on a ray.data.Dataset: every worker pulls its own split, a step means what `step` means, and
fit keeps the next step in flight as it does for a list of batches.

The loss function records, per worker process, the row ids of every local batch it trained on;
the global batches rebuilt from those records (rank 0's rows, then rank 1's) are replayed through
`trainer.step` on a second Trainer, which must give the same losses and parameters.
"""
import json
import logging
import os
import time

import numpy as np
import pytest
import torch

import zeroray as zr
from tests.models import SEQ, VOCAB, lm_loss, parity_model
from zeroray.runtime.worker.local_feed import to_tensors

ROWS, GLOBAL, WORKERS = 48, 8, 2
STEPS = ROWS // GLOBAL  # equal splits of 24 rows, local batches of 4: 6 steps in one pass
STEP_S = 0.2


def test_columns_become_tensors():
    out = to_tensors({"id": np.arange(3), "x": np.ones((3, 2), dtype=np.float32),
                      "rows": np.array([np.zeros(2), np.ones(2), np.ones(2)], dtype=object),
                      "flag": np.array([True, False, True])})
    assert out["id"].dtype == torch.int64 and out["x"].shape == (3, 2) and out["rows"].shape == (3, 2)
    assert out["flag"].dtype == torch.bool
    frozen = np.arange(4)
    frozen.flags.writeable = False
    assert to_tensors({"a": frozen})["a"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="'text'.*drop_columns"):
        to_tensors({"text": np.array(["a", "b"])})
    with pytest.raises(ValueError, match="'ragged'.*different shapes"):
        to_tensors({"ragged": np.array([np.zeros(2), np.zeros(3)], dtype=object)})


def _id_logging_loss(log_dir):
    def loss(model, batch):
        # One line per local batch, in step order, in a file named after the worker's pid.
        with open(os.path.join(log_dir, f"{os.getpid()}.ids"), "a") as f:
            f.write(" ".join(str(i) for i in batch["id"].tolist()) + "\n")
        time.sleep(STEP_S)  # long enough that the next step's call surely arrives during this one
        return lm_loss(model, (batch["idx"], batch["tgt"]))
    return loss


def _dict_loss(model, batch):
    return lm_loss(model, (batch["idx"], batch["tgt"]))


def _trainer(loss_fn, metrics_path=None):
    return zr.Trainer(parity_model, loss_fn, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=3), scaling=zr.ScalingConfig(num_workers=WORKERS),
                      metrics_path=metrics_path)


def test_fit_on_dataset_equals_step_on_the_same_rows(ray_local, tmp_path, caplog):
    import ray.data

    caplog.set_level(logging.INFO, logger="zeroray")

    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    dataset = ray.data.from_items([{"id": i, "idx": idx[i].numpy(), "tgt": tgt[i].numpy()} for i in range(ROWS)],
                                  override_num_blocks=4)

    metrics = tmp_path / "metrics.jsonl"
    with _trainer(_id_logging_loss(str(tmp_path)), str(metrics)) as trainer:
        with pytest.raises(ValueError, match="divisible by 2"):
            trainer.fit(dataset, batch_size=7)
        with pytest.raises(ValueError, match="needs batch_size"):
            trainer.fit(dataset)
        first = trainer.fit(dataset, num_steps=2, batch_size=GLOBAL)
        # A second fit continues at data_position 2: a fresh pass whose first 2 local batches each
        # worker skips ([Note: Ray Data replay]); it stops when the splits run out.
        rest = trainer.fit(dataset, batch_size=GLOBAL)
        assert (len(first), len(rest)) == (2, STEPS - 2)
        assert trainer.step_count == STEPS and trainer.data_position == STEPS
        # The workers pull their batches, and fit still keeps the next step in flight: its call
        # was on the worker before the current step's engine work ended ([Note: pipelined steps]).
        for results in (first, rest):
            for now, after in zip(results, results[1:]):
                assert after.timeline["actor_start"] < now.timeline["engine_end"], (now.timeline, after.timeline)
        state = trainer.state_dict()
        pids = [w["pid"] for w in trainer.workers]

    # Progress of fit (not a tty here): log lines, and one JSONL record per step.
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroray" and "zeroray step" in r.getMessage()]
    assert lines[0].startswith("zeroray step 1 (1/2) loss") and lines[-1].startswith(f"zeroray step {STEPS} loss")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # tokens per step: the largest column, idx or tgt (GLOBAL x SEQ elements)
    assert all(r["loss"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in records)

    per_rank = []
    for pid in pids:
        with open(tmp_path / f"{pid}.ids") as f:
            per_rank.append([[int(i) for i in line.split()] for line in f])
    assert [len(lines) for lines in per_rank] == [STEPS] * WORKERS
    global_ids = [sum((lines[step] for lines in per_rank), []) for step in range(STEPS)]
    assert all(len(ids) == GLOBAL for ids in global_ids)
    for fit_ids in (global_ids[:2], global_ids[2:]):  # no row twice within one pass
        flat = sum(fit_ids, [])
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(ROWS))

    with _trainer(_dict_loss) as replay:
        for step, ids in enumerate(global_ids):
            ids = torch.tensor(ids)
            res = replay.step({"id": ids, "idx": idx[ids], "tgt": tgt[ids]})
            assert res.loss == pytest.approx((first + rest)[step].loss, rel=1e-5, abs=1e-6), f"step {step}"
            assert res.grad_norm == pytest.approx((first + rest)[step].grad_norm, rel=1e-4)
        want = replay.state_dict()
    assert list(state) == list(want)
    for name in want:
        assert (state[name] - want[name]).abs().max().item() <= 1e-5, name
