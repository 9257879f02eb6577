"""The worker actor: one rank's Engine inside a Ray actor.

The actor is threaded (``max_concurrency=2``): training runs on one thread while the other
still answers ``ping`` and report calls from the driver (Ray Train v2's pattern), so the
driver can tell a slow step from a dead worker.
"""
from __future__ import annotations

import os
import resource
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from zeroray.runtime.batch_transport import unpack


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _peak_rss_bytes()


class Worker:
    def __init__(self, rank: int, world_size: int, threads: int, use_gpu: bool) -> None:
        self.rank, self.world_size, self.use_gpu = rank, world_size, use_gpu
        torch.set_num_threads(threads)
        self.engine = None
        self.group = None
        self._lock = threading.Lock()
        self.last_step_time = 0.0
        self.feed = None  # this worker's Ray Data split while fit(dataset) runs (runtime/data.py)

    # --- wiring ----------------------------------------------------------------------------

    def node_info(self) -> Dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "host": socket.gethostname(),
                "gpu_ids": ray.get_gpu_ids() if self.use_gpu else []}

    def free_port(self) -> int:
        from zeroray.comm.group import free_port

        return free_port()

    def ping(self) -> int:
        return self.rank

    def progress(self) -> Dict[str, Any]:
        """How far this rank got in the current step; answered on the second thread while a step
        runs, so the driver can name the ranks that did not reach a collective."""
        counter = self.group.counter if self.group is not None else None
        calls = sum(s.calls for s in list(counter.collectives.values())) if counter is not None else 0
        return {"rank": self.rank, "step": self.engine.step_count if self.engine is not None else None,
                "collectives": calls, "busy": self._lock.locked()}

    def setup(self, spec: Dict[str, Any], master_addr: str, master_port: int) -> Dict[str, Any]:
        """Join the collective group and build this rank's engine."""
        from zeroray.comm.group import make_torch_group
        from zeroray.engine import Engine

        zero = spec["zero"]
        device = "cpu"
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            device = "cuda:0"
        backend = "nccl" if self.use_gpu else "gloo"
        self.group = make_torch_group(backend, self.rank, self.world_size, master_addr, master_port,
                                      timeout_s=zero.collective_timeout_s, store_prefix=spec.get("group_name", "zr"))
        t0 = time.perf_counter()
        self.engine = Engine(spec["model_fn"], spec["loss_fn"], spec["optimizer"], zero, self.group,
                             seed=spec["seed"], device=device, param_groups=spec.get("param_groups"),
                             scheduler=spec.get("scheduler"))
        return {"layout": self.engine.layout.to_dict(), "build_s": time.perf_counter() - t0,
                "peak_rss_bytes": _peak_rss_bytes(), "state_dict_keys": list(self.engine.model.state_dict(keep_vars=True).keys())}

    # --- training --------------------------------------------------------------------------

    def train_step(self, batch: Any) -> Dict[str, Any]:
        t_start = time.time()
        with self._lock:
            t_engine = time.time()
            stats = self.engine.train_step(unpack(batch))
            t_engine_end = time.time()
        self.last_step_time = stats.time_s
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, "step": stats.step, "skipped": stats.skipped,
                "loss_scale": stats.loss_scale, "time_s": stats.time_s,
                "hops": {"actor_start": t_start, "engine_start": t_engine, "engine_end": t_engine_end,
                         "actor_end": time.time()}}

    # --- Ray Data input (runtime/data.py) ------------------------------------------------------

    def attach_data(self, split: Any, batch_size: int, skip: int, feed_id: str) -> Dict[str, Any]:
        """Take this rank's split of a ray.data.Dataset; skip ``skip`` local batches, read one ahead."""
        from zeroray.runtime.data import LocalFeed

        self.feed = LocalFeed(split, batch_size, skip, feed_id)
        return self.feed.peek_info()

    def train_next(self) -> Dict[str, Any]:
        """One step on this rank's next local batch; says whether another one follows."""
        if self.feed is None:
            raise RuntimeError("train_next: no Ray Data split is attached to this worker")
        out = self.train_step(self.feed.take())
        self.feed.advance()
        out["has_next"] = self.feed.has_next()
        return out

    def detach_data(self, feed_id: str) -> None:
        # By id: on this threaded actor a late detach of the last fit must not drop the next fit's split.
        if self.feed is not None and self.feed.feed_id == feed_id:
            self.feed = None

    # --- inspection ------------------------------------------------------------------------

    def master_pieces(self, names: Optional[List[str]] = None) -> Dict[str, Any]:
        names = names if names is not None else self.engine.layout.param_names
        return {n: self.engine.master_piece(n) for n in names}

    def untrained_state(self) -> Dict[str, torch.Tensor]:
        return self.engine.untrained_state()

    def comm_report(self) -> Dict[str, Any]:
        report = self.group.counter.as_dict()
        report["rank"] = self.rank
        report.update(self.engine.fetch_stats())
        report.update(self.engine.bucket_stats())
        return report

    def memory_report(self) -> Dict[str, Any]:
        from zeroray.memory_report import measure

        report = measure(self.engine)
        report["rank"] = self.rank
        report["peak_rss_bytes"] = _peak_rss_bytes()
        report["rss_bytes"] = _current_rss_bytes()
        return report

    # --- state -----------------------------------------------------------------------------

    def export_state(self) -> Dict[str, Any]:
        tensors, scalars = self.engine.export_state()
        return {"tensors": tensors, "scalars": scalars, "layout": self.engine.layout.to_dict()}

    def save_shard(self, root: str, step: int) -> Any:
        from zeroray.checkpoint import write_shard, write_extra

        tensors, scalars = self.engine.export_state()
        info = write_shard(root, step, self.rank, tensors, scalars)
        extra = write_extra(root, step, self.engine.untrained_state()) if self.rank == 0 else None
        return info, extra

    def load_checkpoint(self, path: str) -> int:
        from zeroray.checkpoint import load_resharded

        layout, rank = self.engine.state_layout()
        tensors, scalars = load_resharded(path, layout, rank)
        self.engine.import_state(tensors, scalars)
        return self.engine.step_count

    def load_from_states(self, old_layout: Dict[str, Any], old_states: List[Any]) -> int:
        """In-place resize: assemble this rank's state from the old workers' exported states."""
        from zeroray.arena import FlatLayout
        from zeroray.checkpoint import reshard_in_memory

        import ray

        states = [s if isinstance(s, dict) else ray.get(s) for s in old_states]
        layout, rank = self.engine.state_layout()
        merged = reshard_in_memory(FlatLayout.from_dict(old_layout),
                                   [{**s["tensors"], "scalars": s["scalars"]} for s in states], layout, rank)
        scalars = merged.pop("scalars", {}) or {}
        self.engine.import_state(merged, scalars)
        return self.engine.step_count

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.group is not None:
            self.group.close()
