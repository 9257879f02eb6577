"""zeroray.tracking and the callback dispatcher without Ray: each tracker fed fit's events by hand
and read back with its own package (tests/tracking_readback.py); the extra named when a package is
missing; every callback's on_fit_end runs even when one raises."""
import logging
import sys

import pytest

import zeroray as zr
from tests.tracking_readback import (as_float32, mlflow_history, mlflow_runs, tensorboard_scalars, wandb_history,
                                     wandb_run_files)
from zeroray.runtime.fit.callbacks import Callbacks
from zeroray.runtime.execution.step import StepResult
from zeroray.tracking import MLflowCallback, TensorBoardCallback, WandbCallback


def _result(step, loss, loss_scale=None):
    return StepResult(loss=loss, grad_norm=0.1 * step + 1e-9, step=step, loss_scale=loss_scale, step_time_s=0.25 / step)


FIRST = {s: 1.0 / 3 + s * 1e-13 for s in (1, 2, 3)}     # floats that float32 would not keep
REPLAY = {2: 7.0 / 11, 3: 5.0 / 13, 4: 1.0 / 7}         # after a "recovery" to step 1: other values, to tell them apart


def _feed(tracker):
    """A standalone evaluate at step 0, a fit of 3 steps with an evaluation at step 2, a recovery
    to step 1 and the replayed steps 2-4 (fp16: a loss scale)."""
    with tracker:
        tracker.on_evaluation(0, {"loss": 2.0 / 3, "accuracy": 0.125})
        tracker.on_fit_start(0)
        for step, loss in FIRST.items():
            if step == 2:
                tracker.on_evaluation(2, {"loss": 0.1 + 1e-15, "accuracy": 0.5})
            tracker.on_step(_result(step, loss, loss_scale=2.0 ** 16))
        tracker.on_recovery({"step": 1})
        for step, loss in REPLAY.items():
            tracker.on_step(_result(step, loss, loss_scale=2.0 ** 15))
        tracker.on_fit_end(4, None)


def _expected_steps(losses):
    return {"train/loss": dict(losses), "train/grad_norm": {s: 0.1 * s + 1e-9 for s in losses},
            "train/step_time_s": {s: 0.25 / s for s in losses}}


def test_each_tracker_logs_the_exact_values_and_treats_a_replay_as_its_reader_does(tmp_path):
    evals = {"eval/loss": {0: 2.0 / 3, 2: 0.1 + 1e-15}, "eval/accuracy": {0: 0.125, 2: 0.5}}

    _feed(TensorBoardCallback(tmp_path / "tb"))
    got = tensorboard_scalars(tmp_path / "tb")
    want = _expected_steps({1: FIRST[1], **REPLAY})  # EventAccumulator drops the points the replay orphaned
    for name, series in as_float32({**want, **evals}).items():  # TensorBoard keeps float32
        assert got[name] == series, name
    assert got["train/loss_scale"] == {1: 2.0 ** 16, 2: 2.0 ** 15, 3: 2.0 ** 15, 4: 2.0 ** 15}

    mlf = MLflowCallback(tmp_path / "mlflow", params={"lr": 0.01})
    _feed(mlf)
    client, runs = mlflow_runs(mlf.tracking_uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].data.params == {"lr": "0.01"}
    history = mlflow_history(mlf.tracking_uri, runs[0].info.run_id)
    assert history["train/loss"] == list(FIRST.items()) + list(REPLAY.items())  # MLflow keeps both
    assert {name: dict(points) for name, points in history.items() if name.startswith("eval/")} == evals

    _feed(WandbCallback(tmp_path / "wandb", config={"lr": 0.01}))
    [run_file] = wandb_run_files(tmp_path / "wandb")
    got = wandb_history(run_file)
    want = _expected_steps({**FIRST, 4: REPLAY[4]})  # W&B's steps only go forward: the first values stay
    for name, series in {**want, **evals}.items():
        assert got[name] == series, name


@pytest.mark.parametrize("tracker,package,extra", [(TensorBoardCallback, "tensorboard", "tensorboard"),
                                                   (MLflowCallback, "mlflow", "mlflow"),
                                                   (WandbCallback, "wandb", "wandb")])
def test_a_missing_package_names_its_extra(tmp_path, monkeypatch, tracker, package, extra):
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ImportError, match=rf"{tracker.__name__} needs the '{package}' package.*"
                                          rf"pip install 'zeroray\[{extra}\]'"):
        tracker(tmp_path)


class _Ends(zr.Callback):
    def __init__(self, log, fails=False):
        self.log, self.fails = log, fails

    def on_fit_end(self, step, error):
        self.log.append((self, step, error))
        if self.fails:
            raise OSError("disk full")


def test_every_on_fit_end_runs_and_fits_own_error_wins(caplog):
    ended = []
    first, second = _Ends(ended, fails=True), _Ends(ended)
    hooks = Callbacks([first, second])
    with pytest.raises(OSError, match="disk full"):  # fit returned: the callback's error is raised
        hooks.fit_end(3, None)
    assert ended == [(first, 3, None), (second, 3, None)]
    ended.clear()
    cause = KeyError("from the data")
    with caplog.at_level(logging.ERROR, logger="zeroray"):
        hooks.fit_end(2, cause)  # fit is failing: logged, and fit raises its own error
    assert ended == [(first, 2, cause), (second, 2, cause)]
    assert "_Ends.on_fit_end raised while fit was failing" in caplog.text
    with pytest.raises(ValueError, match="callbacks must be zr.Callback objects"):
        Callbacks([print])
