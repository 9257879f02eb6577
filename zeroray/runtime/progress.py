"""Progress of fit: a bar in a terminal or notebook, plain log lines otherwise; JSONL and Ray metrics."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Optional

log = logging.getLogger("zeroray")


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Progress:
    def __init__(self, total: Optional[int], initial: int = 0, metrics_path: Optional[str] = None,
                 tokens_per_step: Optional[int] = None, log_every: int = 10) -> None:
        self.total, self.tokens_per_step, self.log_every = total, tokens_per_step, log_every
        self.bar = None
        if _interactive():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, desc="zeroray", dynamic_ncols=True)
            except ImportError:
                self.bar = None
        self.metrics_file = None
        if metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
            self.metrics_file = open(metrics_path, "a")
        self._ray_metrics = None
        self._t_last = time.perf_counter()

    def _gauges(self):
        if self._ray_metrics is None:
            try:
                from ray.util.metrics import Gauge

                self._ray_metrics = {k: Gauge(f"zeroray_{k}", description=f"zeroray {k}")
                                     for k in ("loss", "step_time_s", "tokens_per_s")}
            except Exception:  # metrics need a connected Ray; progress must never fail training
                self._ray_metrics = {}
        return self._ray_metrics

    def update(self, result: Any) -> None:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        tps = self.tokens_per_step / dt if self.tokens_per_step and dt > 0 else None
        record = {"step": result.step, "loss": result.loss, "grad_norm": result.grad_norm,
                  "step_time_s": result.step_time_s, "skipped": result.skipped, "time": time.time()}
        if tps:
            record["tokens_per_s"] = tps
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{result.loss:.4f}", "s/step": f"{result.step_time_s:.2f}"}
            if tps:
                post["tok/s"] = f"{tps:.0f}"
            self.bar.set_postfix(post)
        elif result.step % self.log_every == 0 or (self.total and result.step >= self.total):
            extra = f" tokens/s {tps:.0f}" if tps else ""
            print(f"zeroray step {result.step}{'/' + str(self.total) if self.total else ''} loss {result.loss:.4f} "
                  f"step time {result.step_time_s:.3f}s{extra}", flush=True)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        for k, g in self._gauges().items():
            if k in record:
                g.set(record[k])

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)
        log.warning(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
