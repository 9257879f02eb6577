"""The zeroray rows: stages 0-3 through the public API only (zr.Trainer, as a user would).

Everything here goes through ``zr.Trainer``; each stage gets a fresh trainer on the same
global batches as the torch peers. The reports are read defensively: a key the runtime does
not (yet) provide leaves a blank in the table instead of failing the benchmark.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from common import BENCHMARKS, EXAMPLES, BenchSpec, StepClock, add_import_paths, global_batches, model_fn, proc_stat


class ZeroraySession:
    """Imports zeroray once, runs stages, and shuts down the Ray it caused to start (only that)."""

    def __init__(self) -> None:
        add_import_paths()
        # Ray ships the driver's sys.path to local workers; PYTHONPATH covers workers started
        # by a raylet that inherited this environment. Both make `import gpt` work in actors.
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        for path in (EXAMPLES, BENCHMARKS):
            if path not in paths:
                paths.insert(0, path)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        # Ray starts its workers at niceness 15: on a machine other work shares, they would then
        # wait behind every ordinary process while the torch and DeepSpeed rows and the floor
        # (plain processes, niceness 0) do not, and the zeroray rows would measure the neighbours.
        # The Ray this session starts runs them at 0, like every other row.
        os.environ.setdefault("RAY_worker_niceness", "0")
        import ray

        import zeroray as zr

        self.zr, self.ray = zr, ray
        self._ray_was_up = ray.is_initialized()
        if self._ray_was_up or os.environ.get("RAY_ADDRESS"):
            _pickle_examples_by_value()  # a remote cluster's workers have no examples/ on disk

    def run(self, stage: int, spec: BenchSpec, *, prefetch: bool, zero: Optional[dict] = None,
            comm_every_step: bool = False) -> dict:
        """``zero``: further ZeroConfig fields (the bucket rows). ``comm_every_step``: read
        comm_report() after every step (outside the timed part), not only after the last."""
        return self.run_interleaved({"row": (stage, zero)}, spec, prefetch=prefetch,
                                    comm_every_step=comm_every_step)["row"]

    def run_interleaved(self, rows: Dict[str, Tuple[int, Optional[dict]]], spec: BenchSpec, *, prefetch: bool,
                        comm_every_step: bool = False) -> Dict[str, dict]:
        """Several rows ({name: (stage, ZeroConfig fields)}) at once: every row's trainer is built
        first, then they take turns, one step each (row A's step 1, row B's step 1, ...), so a
        machine whose speed drifts over minutes slows every row alike. One row: ``run``."""
        runs = self.open_runs(rows, spec, prefetch=prefetch, comm_every_step=comm_every_step)
        try:
            for batch in global_batches(spec):
                for run in runs.values():
                    run.step(batch)
            return {name: run.record() for name, run in runs.items()}
        finally:
            for run in runs.values():
                run.close()

    def open_runs(self, rows: Dict[str, Tuple[int, Optional[dict]]], spec: BenchSpec, *, prefetch: bool,
                  comm_every_step: bool = False) -> Dict[str, "_Run"]:
        """Every row's trainer, built and ready to step (the caller closes them)."""
        import bench_models

        zr = self.zr
        runs: Dict[str, _Run] = {}
        try:
            for name, (stage, zero) in rows.items():
                runs[name] = _Run(zr.Trainer(
                    model_fn(spec),
                    bench_models.lm_loss,
                    optimizer=zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                    zero=zr.ZeroConfig(stage=stage, prefetch=prefetch, **(zero or {})),
                    scaling=zr.ScalingConfig(num_workers=spec.num_workers, threads_per_worker=spec.threads),
                    seed=spec.seed,
                ), StepClock(spec.warmup_steps), comm_every_step)
        except BaseException:
            for run in runs.values():
                run.close()
            raise
        return runs

    def close(self) -> None:
        if not self._ray_was_up and self.ray.is_initialized():
            self.ray.shutdown()  # the embedded local Ray that zr.Trainer started for us


class _Run:
    """One row's trainer and what it measured so far."""

    def __init__(self, trainer, clock: StepClock, comm_every_step: bool = False) -> None:
        self.trainer, self.clock, self.comm_every_step = trainer, clock, comm_every_step
        self.losses: List[float] = []
        self.comm_steps: List[Any] = []
        # The workers' processes, to read the CPU they use between steps (peers._train's idle_cpu_s).
        self.pids: List[int] = [w["pid"] for w in trainer.workers]
        self.idle_cpu: List[List[float]] = []
        self._cpu_at_stop: Optional[List[float]] = None

    def _workers_cpu(self) -> Optional[List[float]]:
        try:
            return [proc_stat(pid).cpu_s for pid in self.pids]
        except OSError:  # a worker on another node, or gone
            return None

    def step(self, batch) -> None:
        cpu = self._workers_cpu()
        if cpu is not None and self._cpu_at_stop is not None:
            self.idle_cpu.append([now - then for now, then in zip(cpu, self._cpu_at_stop)])
        self.clock.start()
        result = self.trainer.step(batch)
        loss = float(result.loss)
        self.clock.stop()
        self.losses.append(loss)
        if self.comm_every_step:  # outside the timed part
            self.comm_steps.append(_per_worker(_call(self.trainer, "comm_report")))
        self._cpu_at_stop = self._workers_cpu()  # after the report: its work is not the step's

    def close(self) -> None:
        self.trainer.shutdown()

    def record(self) -> dict:
        comm = self.comm_steps[-1] if self.comm_steps else _per_worker(_call(self.trainer, "comm_report"))
        memory = _per_worker(_call(self.trainer, "memory_report"))
        return {
            "step_s": self.clock.times,
            "losses": self.losses,
            "comm": comm,
            "comm_steps": self.comm_steps or None,
            "idle_cpu_s_per_rank": [list(w) for w in zip(*self.idle_cpu)] if self.idle_cpu else None,
            "peak_rss_bytes": [_num(m, "peak_rss_bytes") for m in memory] if memory else None,
            "memory_report": memory,
        }


def _pickle_examples_by_value() -> None:
    import bench_models
    import gpt

    for name in ("cloudpickle", "ray.cloudpickle"):
        try:
            module = __import__(name, fromlist=["register_pickle_by_value"])
            module.register_pickle_by_value(gpt)
            module.register_pickle_by_value(bench_models)
        except (ImportError, AttributeError, ValueError):
            pass


def _call(trainer, method: str) -> Any:
    fn = getattr(trainer, method, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as e:  # a report is a nice-to-have; the step times still stand
        return {"error": f"{method}() raised {type(e).__name__}: {e}"}


def _per_worker(report: Any) -> Optional[List[dict]]:
    """Normalise a report to one dict per worker (a list, a {rank: dict}, or one dict)."""
    if report is None:
        return None
    if isinstance(report, dict):
        if "error" in report and len(report) == 1:
            return [report]
        if report and all(isinstance(v, dict) for v in report.values()) and "collectives" not in report:
            return [report[k] for k in sorted(report, key=str)]
        return [report]
    if isinstance(report, (list, tuple)):
        return [r if isinstance(r, dict) else {"value": r} for r in report]
    return [{"value": report}]


def _num(d: Any, key: str) -> Optional[float]:
    if not isinstance(d, dict):
        return None
    v = d.get(key)
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None
