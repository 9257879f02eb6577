"""zeroray.tracking on a real 2-worker fit: TensorBoard, MLflow and W&B (offline) each logged the
exact step results and evaluations (fit's and a standalone evaluate's), read back with each
package's own reader (tests/tracking_readback.py), once, from the driver only (one event file,
one run; no worker imported a tracker). A user callback sees every step, evaluation, checkpoint
and a recovery from a SIGKILLed worker, in order, and the steps the recovery replays."""
import functools
import glob

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model
from tests.ray.test_faults import KillingData, gated_loss
from tests.ray.test_snapshot_recovery import _arm_kill
from tests.tracking_readback import (as_float32, mlflow_history, mlflow_runs, tensorboard_scalars, wandb_history,
                                     wandb_run_files)
from zeroray.checkpoint import load_manifest
from zeroray.tracking import MLflowCallback, TensorBoardCallback, WandbCallback

STEPS = 4


def accuracy(model, batch):
    idx, tgt = batch
    return {"accuracy": (model(idx).argmax(-1) == tgt).float().mean()}


def no_tracker_imported(model):
    """Runs on every worker (trainer.run); raising on any one fails the call."""
    import sys

    held = [m for m in ("zeroray.tracking", "torch.utils.tensorboard", "tensorboard", "mlflow", "wandb")
            if m in sys.modules]
    if held:
        raise AssertionError(f"a worker imported {held}")
    return True


def _expected(results, evaluations):
    out = {"train/loss": {r.step: r.loss for r in results}, "train/grad_norm": {r.step: r.grad_norm for r in results},
           "train/step_time_s": {r.step: r.step_time_s for r in results}}
    for step, metrics in evaluations.items():
        for name, value in metrics.items():
            out.setdefault(f"eval/{name}", {})[step] = value
    return out


def test_a_2_worker_fit_logs_exactly_its_results_once(ray_local, tmp_path):
    batches, held_out = make_batches(STEPS), make_batches(2, seed=7)
    trackers = [TensorBoardCallback(tmp_path / "tb"), MLflowCallback(tmp_path / "mlflow"),
                WandbCallback(tmp_path / "wandb")]
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(lr=1e-2), zero=zr.ZeroConfig(stage=2),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        before = trainer.evaluate(held_out, accuracy, callbacks=trackers)  # logged at step 0
        results = trainer.fit(batches, progress=False, eval_data=held_out, eval_every=2, eval_metric_fn=accuracy,
                              callbacks=trackers)
        assert trainer.run(no_tracker_imported) is True
    for tracker in trackers:
        tracker.close()
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    want = _expected(results, {0: before, 2: results[1].evaluation, 4: results[3].evaluation})
    assert set(want) == {"train/loss", "train/grad_norm", "train/step_time_s", "eval/loss", "eval/accuracy"}

    assert len(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) == 1
    assert tensorboard_scalars(tmp_path / "tb") == as_float32(want)  # TensorBoard keeps float32

    _, runs = mlflow_runs(trackers[1].tracking_uri)
    assert len(runs) == 1
    history = mlflow_history(trackers[1].tracking_uri, runs[0].info.run_id)
    assert {name: dict(points) for name, points in history.items()} == want
    assert all(len(points) == len(want[name]) for name, points in history.items())  # each value once

    [run_file] = wandb_run_files(tmp_path / "wandb")
    assert wandb_history(run_file) == want


class Recorder(zr.Callback):
    def __init__(self):
        self.events = []

    def on_fit_start(self, step):
        self.events.append(("start", step))

    def on_step(self, result):
        self.events.append(("step", result.step))

    def on_evaluation(self, step, metrics):
        self.events.append(("eval", step, metrics["loss"]))

    def on_checkpoint(self, step, path):
        self.events.append(("checkpoint", step, path))

    def on_recovery(self, record):
        self.events.append(("recovery", record))

    def on_fit_end(self, step, error):
        self.events.append(("end", step, error))


def test_a_callback_sees_steps_evaluations_checkpoints_and_a_recovery(ray_local, tmp_path):
    steps, kill_at = 6, 4  # worker 1 dies inside step 5; the last checkpoint is step 3's
    batches = make_batches(steps)
    gate = tmp_path / "gate"
    gate.mkdir()
    recorder, tb = Recorder(), TensorBoardCallback(tmp_path / "tb")
    with zr.Trainer(parity_model, functools.partial(gated_loss, str(gate)), optimizer=zr.AdamW(lr=1e-2),
                    zero=zr.ZeroConfig(stage=2, collective_timeout_s=10.0), scaling=zr.ScalingConfig(num_workers=2),
                    failure=zr.FailureConfig(max_failures=1),
                    checkpoint=zr.CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=3)) as trainer:
        arm, landed, target = _arm_kill(trainer, gate, batches[kill_at])
        results = trainer.fit(KillingData(batches, kill_at, arm), progress=False, eval_data=batches[:1], eval_every=2,
                              callbacks=[recorder, tb])
        assert landed == {"batch": target}, landed
        recoveries = list(trainer.recoveries)
    tb.close()
    events = recorder.events
    kinds = [e[0] if e[0] in ("start", "recovery", "end") else e[:2] for e in events]
    assert kinds == ["start", ("step", 1), ("eval", 2), ("step", 2), ("checkpoint", 3), ("step", 3), ("eval", 4),
                     ("step", 4), "recovery",  # resumed at step 3's checkpoint: step 4 again
                     ("eval", 4), ("step", 4), ("step", 5), ("checkpoint", 6), ("eval", 6), ("step", 6), "end"], kinds
    assert events[0] == ("start", 0) and events[-1] == ("end", steps, None)
    [recovery] = [e[1] for e in events if e[0] == "recovery"]
    assert len(recoveries) == 1 and recovery == recoveries[0] and recovery["step"] == 3, recovery
    for _, step, path in [e for e in events if e[0] == "checkpoint"]:
        assert load_manifest(path).step == step
    evals = [e for e in events if e[0] == "eval"]
    assert evals[1][2] == evals[2][2]  # step 4 replayed from step 3's checkpoint evaluates the same
    assert [r.step for r in results] == list(range(1, steps + 1))
    assert tensorboard_scalars(tmp_path / "tb")["train/loss"] == as_float32({"l": {r.step: r.loss for r in results}})["l"]
