"""fit's progress: log lines or a bar, the JSONL metrics file, Ray gauges, the `zeroray` logger.

These drive `Progress` directly with step results (no actors); tests/ray/test_ray_data.py checks
the same outputs from a real `fit`.
"""
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zeroray.runtime.fit import progress as progress_mod
from zeroray.runtime.fit.progress import Progress


class FakeGauge:
    def __init__(self):
        self.values = []

    def set(self, value):
        self.values.append(value)


def _results(n, first_step=101):
    return [SimpleNamespace(step=first_step + i, loss=2.0 - 0.1 * i, grad_norm=1.0, step_time_s=0.01,
                            skipped=False) for i in range(n)]


def test_log_lines_jsonl_and_gauges(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(progress_mod, "_interactive", lambda: False)
    caplog.set_level(logging.INFO, logger="zeroray")
    path = tmp_path / "run" / "metrics.jsonl"
    bar = Progress(12, metrics_path=str(path), tokens_per_step=640)
    gauges = {k: FakeGauge() for k in progress_mod.GAUGES}
    bar._ray_metrics = gauges
    for r in _results(12):
        bar.update(r)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroray"]
    # The first step, every 10th and the last; counted within this fit, the global step shown too.
    assert [line.split(" loss")[0] for line in lines] == [
        "zeroray step 101 (1/12)", "zeroray step 110 (10/12)", "zeroray step 112 (12/12)"]
    assert all("step time" in line and "tokens/s" in line for line in lines)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(101, 113))
    for r in records:
        assert r["loss"] > 0 and r["step_time_s"] == 0.01 and r["tokens_per_s"] > 0
    assert gauges["loss"].values[-1] == pytest.approx(0.9) and len(gauges["tokens_per_s"].values) == 12


def test_last_step_logged_when_total_unknown(monkeypatch, caplog):
    monkeypatch.setattr(progress_mod, "_interactive", lambda: False)
    caplog.set_level(logging.INFO, logger="zeroray")
    bar = Progress(None)  # fit(data) that runs until the data ends
    bar._ray_metrics = {}
    for r in _results(3):
        bar.update(r)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroray"]
    assert [line.split(" loss")[0] for line in lines] == ["zeroray step 101", "zeroray step 103"]


def test_bar_when_interactive(monkeypatch, capsys):
    monkeypatch.setattr(progress_mod, "_interactive", lambda: True)
    bar = Progress(3, tokens_per_step=100)
    bar._ray_metrics = {}
    for r in _results(3):
        bar.update(r)
    assert bar.bar is not None and bar.bar.n == 3
    bar.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=" in err and "tok/s=" in err and "s/step=" in err


def test_evaluations_of_fit(monkeypatch, caplog, capsys, tmp_path):
    # Log lines: the held-back step line first, then the evaluation's; a JSONL record; the gauge.
    monkeypatch.setattr(progress_mod, "_interactive", lambda: False)
    caplog.set_level(logging.INFO, logger="zeroray")
    path = tmp_path / "metrics.jsonl"
    bar = Progress(12, metrics_path=str(path))
    gauges = {k: FakeGauge() for k in progress_mod.GAUGES}
    bar._ray_metrics = gauges
    for r in _results(2):
        bar.update(r)
    bar.evaluation(102, {"loss": 1.25, "acc": 0.5})
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroray"]
    assert [line.split(" loss")[0] for line in lines] == ["zeroray step 101 (1/12)", "zeroray step 102 (2/12)",
                                                           "zeroray step 102 eval"]
    assert lines[-1] == "zeroray step 102 eval loss 1.2500 acc 0.5000"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {k: v for k, v in records[-1].items() if k != "time"} == {"step": 102, "eval_loss": 1.25, "eval_acc": 0.5}
    assert gauges["eval_loss"].values == [1.25] and len(gauges["loss"].values) == 2
    # In a bar: the postfix shows it, and keeps it through the next steps.
    monkeypatch.setattr(progress_mod, "_interactive", lambda: True)
    bar = Progress(3)
    bar._ray_metrics = {}
    bar.update(_results(1)[0])
    bar.evaluation(101, {"loss": 1.25})
    bar.update(_results(2)[1])
    assert bar.bar.postfix.startswith("loss=1.9000") and "eval_loss=1.2500" in bar.bar.postfix
    bar.close()


def test_plain_lines_reach_stdout_without_logging_config():
    # A fresh interpreter with no logging configured, stderr not a tty: what a Ray job's driver sees.
    code = ("from types import SimpleNamespace as S; from zeroray.runtime.fit.progress import Progress\n"
            "p = Progress(2); p._ray_metrics = {}\n"
            "[p.update(S(step=i, loss=1.5, grad_norm=1.0, step_time_s=0.2, skipped=False)) for i in (1, 2)]\n"
            "p.note('a note'); p.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "zeroray step 1 (1/2) loss 1.5000 step time 0.200s" in out.stdout
    assert "zeroray step 2 (2/2)" in out.stdout and "a note" in out.stdout


def test_importing_ipykernel_is_not_a_notebook():
    pytest.importorskip("ipykernel")  # e.g. a test session that collected the notebook test
    assert not progress_mod._in_jupyter_kernel()
    assert not progress_mod._interactive()  # pytest captures stderr: not a tty


def test_zeroray_logger():
    assert progress_mod.log is logging.getLogger("zeroray")
    from zeroray.runtime.controller import controller
    from zeroray.runtime.fit import loop as fit_loop

    assert fit_loop.log is controller.log is progress_mod.log
