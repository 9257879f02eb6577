"""Progress of fit: a bar in a terminal or notebook, plain log lines otherwise; JSONL and Ray metrics.

[Note: progress output]
- Attached to a terminal (stderr is a tty) or running in a Jupyter kernel: a tqdm bar with
  steps, loss, step time and tokens/s (the notebook widget when ipywidgets is installed, the
  text bar otherwise, so a notebook without ipywidgets does not warn).
- Otherwise (a Ray job, a batch script, CI): INFO records of the ``zeroray`` logger, one for the
  first step of a fit, every ``log_every``-th step and the last. When the application has configured
  no logging at all, a stdout handler is attached to the ``zeroray`` logger so the lines show in
  job logs; configured logging (a root handler) gets the records instead. ``zeroray`` logger
  records below INFO are dropped unless the application sets that logger's level itself.
- ``Trainer(metrics_path=...)``: one JSON record per step (step, loss, grad_norm, step_time_s,
  tokens_per_s, skipped, time), appended and flushed as it happens; one per evaluation of fit
  (step, eval_loss, eval_<metric>, time), which also shows in the bar's postfix (``eval_loss``,
  kept until the next one) or as a log line of its own.
- Ray metrics: gauges ``zeroray_loss``, ``zeroray_step_time_s``, ``zeroray_tokens_per_s``,
  ``zeroray_eval_loss`` (``ray.util.metrics``), shown by the dashboard's metrics view when
  Prometheus scrapes it.
Progress must never fail training: metric errors are logged once and otherwise ignored.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Dict, Optional

log = logging.getLogger("zeroray")

GAUGES = ("loss", "step_time_s", "tokens_per_s", "eval_loss")


def _in_jupyter_kernel() -> bool:
    """Code running in a Jupyter kernel (not merely a process that imported ipykernel or IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _interactive() -> bool:
    if _in_jupyter_kernel():
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def _tqdm():
    """The notebook bar only where it can render (ipywidgets), else the text bar."""
    if _in_jupyter_kernel():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm

            return tqdm
        except ImportError:
            pass
    from tqdm import tqdm

    return tqdm


def ensure_log_output() -> None:
    """Make the ``zeroray`` logger's INFO records visible; see [Note: progress output]."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


class Progress:
    """One fit's progress output: bar or log lines, JSONL records, Ray gauges ([Note: progress output])."""

    def __init__(self, total: Optional[int], initial: int = 0, metrics_path: Optional[str] = None,
                 tokens_per_step: Optional[int] = None, log_every: int = 10) -> None:
        self.total, self.tokens_per_step, self.log_every = total, tokens_per_step, log_every
        self.done = 0  # steps of this fit
        self.bar = None
        if _interactive():
            try:
                self.bar = _tqdm()(total=total, initial=initial, desc="zeroray", unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None
        if self.bar is None:
            ensure_log_output()
        self.metrics_file = None
        if metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
            self.metrics_file = open(metrics_path, "a")
        self._ray_metrics: Optional[Dict[str, Any]] = None
        self._t_last = time.perf_counter()
        self._unlogged: Optional[tuple] = None  # the last step's log line, until it is logged
        self._post: Dict[str, str] = {}  # the bar's postfix: the last step's values and the last evaluation's

    def _gauges(self) -> Dict[str, Any]:
        if self._ray_metrics is None:
            try:
                from ray.util.metrics import Gauge

                self._ray_metrics = {k: Gauge(f"zeroray_{k}", description=f"zeroray training: {k} of the last "
                                              + ("evaluation" if k.startswith("eval_") else "step"))
                                     for k in GAUGES}
            except Exception as error:  # noqa: BLE001 - metrics need a connected Ray
                log.debug("zeroray: no Ray metrics (%s)", error)
                self._ray_metrics = {}
        return self._ray_metrics

    def update(self, result: Any) -> None:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        self.done += 1
        # Wall time between steps; the first step of a fit has no previous one and its wall time
        # holds the start-up (data, first batches), so it counts the workers' step time instead.
        dt = result.step_time_s if self.done == 1 else dt
        tps = self.tokens_per_step / dt if self.tokens_per_step and dt > 0 else None
        record = {"step": result.step, "loss": result.loss, "grad_norm": result.grad_norm,
                  "step_time_s": result.step_time_s, "tokens_per_s": tps, "skipped": result.skipped,
                  "time": time.time()}
        if self.bar is not None:
            self._post.update({"loss": f"{result.loss:.4f}", "s/step": f"{result.step_time_s:.3f}"})
            if tps:
                self._post["tok/s"] = f"{tps:.0f}"
            self.bar.set_postfix(self._post, refresh=False)
            self.bar.update(1)  # one refresh per step, with the new postfix
        else:
            of = f" ({self.done}/{self.total})" if self.total else ""
            extra = f" tokens/s {tps:.0f}" if tps else ""
            self._unlogged = ("zeroray step %d%s loss %.4f step time %.3fs%s", result.step, of, result.loss,
                              result.step_time_s, extra)
            if self.done == 1 or self.done % self.log_every == 0 or self.done == self.total:
                self._log_line()
        self._record(record)

    def on_collected(self, result: Any, tokens: Optional[int]) -> None:
        """fit reports a collected step (fit/callbacks.py's ``emit``) with its batch's tokens, when known."""
        if tokens is not None:  # each step's own: batches may change shape between steps
            self.tokens_per_step = tokens
        self.update(result)

    def on_evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        self.evaluation(step, metrics)

    def evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        """fit's evaluation after step ``step``: ``metrics`` is evaluate's ``{"loss": ..., **metrics}``."""
        values = {f"eval_{k}": v for k, v in metrics.items()}
        if self.bar is not None:
            self._post.update({k: f"{v:.4f}" for k, v in values.items()})
            self.bar.set_postfix(self._post)
        else:
            self._log_line()  # the step's line first, if it was held back
            log.info("zeroray step %d eval %s", step, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self._record({"step": step, **values, "time": time.time()})

    def _record(self, record: Dict[str, Any]) -> None:
        """One record to the metrics file and the Ray gauges."""
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        gauges = self._gauges()
        if gauges:
            try:
                for k, gauge in gauges.items():
                    if record.get(k) is not None:
                        gauge.set(record[k])
            except Exception as error:  # noqa: BLE001
                log.warning("zeroray: Ray metrics disabled after an error: %s", error)
                self._ray_metrics = {}

    def _log_line(self) -> None:
        if self._unlogged is not None:
            log.info(*self._unlogged)
            self._unlogged = None

    def note(self, message: str) -> None:
        """A warning during fit (a recovery): above the bar when nothing else would show it."""
        if self.bar is not None and not log.hasHandlers():
            self.bar.write(message)
        else:
            log.warning(message)

    def on_fit_end(self, step: int, error: Optional[BaseException]) -> None:
        """fit ends (fit/callbacks.py's ``emit``; the bar is the first reporter): see ``close``."""
        self.close()

    def close(self) -> None:
        """The last step's line shows, the bar and the metrics file close; again, nothing more."""
        self._log_line()  # the last step of a fit always shows
        bar, self.bar = self.bar, None
        if bar is not None:
            bar.close()
        metrics_file, self.metrics_file = self.metrics_file, None
        if metrics_file is not None:
            metrics_file.close()
