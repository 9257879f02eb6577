"""The worker actor: one rank's Engine inside a Ray actor.

The actor is threaded: every call that touches the engine takes a ``Ticket`` and runs in the
order the driver numbered it, one at a time (see [Note: one engine call at a time] in
worker/sequencer.py), while the polls (``node_info``, ``free_port``, ``progress``) run on a thread
of their own (the ``control`` concurrency group) and are answered during a step: the driver
can tell a slow step from a dead worker, and name the ranks that did not reach a collective.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from zeroray.memory.process import ProcessMemory, current_rss_bytes
from zeroray.runtime.batch_transport import unpack
from zeroray.layout.arena import FlatLayout
from zeroray.runtime.records import (CommReport, ExportDone, Hops, MemoryReport, NodeInfo, OptimizerPart,
                                     OptimizerPlan, SavedShard, SetupInfo, SplitInfo, StepRecord, WorkerProgress,
                                     WorkerSpec)
from zeroray.runtime.worker.sequencer import Cancelled, Sequencer, Ticket, engine_call
from zeroray.runtime.worker.snapshot_side import SnapshotSide, snapshot_bytes

log = logging.getLogger("zeroray")

# Concurrency groups of the actor class (worker_group/group.py passes them to ray.remote): the engine
# calls wait for their turn on the default group's threads (a running step, the step queued
# behind it, a save or a report behind that), the polls never wait behind them.
ENGINE_THREADS = 4
# warm: a spare's imports; copy: a buddy's copy of a snapshot shard; neither in the polls' way.
CONCURRENCY_GROUPS = {"control": 1, "warm": 1, "copy": 1}


class Worker:
    """One rank of a worker group: its collective group membership, its Engine, its Ray Data split,
    its half of the in-memory snapshots (``snapshots``, snapshot_side.py)."""

    def __init__(self, rank: int, world_size: int, threads: int, use_gpu: bool) -> None:
        self.rank, self.world_size, self.use_gpu = rank, world_size, use_gpu
        torch.set_num_threads(threads)
        self.engine = None
        self.group = None
        self._sequencer = Sequencer()
        self._arrived = threading.local()
        self.snapshots = SnapshotSide()  # the buddy's copy held here, the copy in progress, the staged state
        # A spare's throwaway build (warm) and its real one (setup) both touch torch's global state
        # (the default generator, seeded by every Engine): never at once.
        self._building = threading.Lock()
        self.feed = None  # this worker's Ray Data split while fit(dataset) runs (runtime/worker/local_feed.py)
        self.memory = ProcessMemory()  # before the model: the baseline; engine work on one thread

    # --- polls: answered at any time, never wait for the engine -------------------------------

    @ray.method(concurrency_group="control")
    def node_info(self) -> NodeInfo:
        ctx = ray.get_runtime_context()
        return NodeInfo(rank=self.rank, node_id=ctx.get_node_id(), ip=ray.util.get_node_ip_address(),
                        pid=os.getpid(), host=socket.gethostname(),
                        gpu_ids=tuple(ray.get_gpu_ids()) if self.use_gpu else (),
                        placement_group_id=ctx.get_placement_group_id())  # zeroray.tune checks it is the trial's

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        from zeroray.comm.port import free_port

        return free_port()

    @ray.method(concurrency_group="control")
    def progress(self) -> WorkerProgress:
        """How far this rank got in the current step, so the driver can name the ranks that did
        not reach a collective. Reads counters the step thread updates: a snapshot, not a lock."""
        counter = self.group.counter if self.group is not None else None
        calls = sum(s.calls for s in list(counter.collectives.values())) if counter is not None else 0
        return WorkerProgress(rank=self.rank, step=self.engine.step_count if self.engine is not None else None,
                              collectives=calls, busy=self._sequencer.busy)

    @ray.method(concurrency_group="warm")
    def warm(self, spec: WorkerSpec) -> str:
        """A spare's start ([Note: replace, don't restart] in worker_group/reform.py): load now what the
        first build of an engine would load, so that taking the spare costs only the rendezvous
        and the build itself. Receiving ``spec`` imports the modules of the model and loss code;
        a throwaway engine over a tiny model, alone in a group of one, with the spec's stage and
        optimizer, imports and first-runs the engine's code (the first torch optimizer imports
        torch._dynamo). Returns this worker's node id (the driver skips a spare whose node is gone).
        A new worker put in a lost rank (it has a rank) only imports: the driver waits for that
        before the re-form's rendezvous ([Note: rendezvous timeout] in worker_group/reform.py)."""
        from zeroray.comm.group import SoloGroup
        from zeroray.config import ZeroConfig
        from zeroray.engine.engine import Engine

        with self._building:
            if self.rank >= 0:  # taken already (setup gave it a rank): its real build does the rest
                return ray.get_runtime_context().get_node_id()
            zero = ZeroConfig(stage=spec.zero.stage, dtype=spec.zero.dtype)
            try:
                engine = Engine(lambda: torch.nn.Linear(4, 4), _throwaway_loss, spec.optimizer, zero, SoloGroup())
                engine.train_step((torch.ones(2, 4),))
                engine.close()
            except Exception as error:  # noqa: BLE001 - a spare warms what it can; its real build says what is wrong
                log.warning("zeroray: a spare's throwaway build failed (%s: %s); it stays a spare, only less warm",
                            type(error).__name__, error)
        return ray.get_runtime_context().get_node_id()

    # --- wiring ----------------------------------------------------------------------------

    @engine_call
    def setup(self, spec: WorkerSpec, master_addr: str, master_port: int, rank: Optional[int] = None,
              world_size: Optional[int] = None, rendezvous_timeout_s: Optional[float] = None) -> SetupInfo:
        """Join the collective group and build this rank's engine. Again, after a failure: leave
        the broken group and drop the engine first, and take ``rank`` (a spare's first setup) and
        ``world_size`` (a group shrunk to its survivors); see [Note: replace, don't restart] and
        [Note: shrink in memory] in worker_group/reform.py. ``rendezvous_timeout_s``: how long joining
        may take (default: the collective timeout), see [Note: rendezvous timeout] in worker_group/reform.py."""
        from zeroray.comm.group import make_torch_group
        from zeroray.comm.user_group import join_default_group
        from zeroray.engine.engine import Engine

        if self.group is not None:
            self._leave_group()
        if rank is not None:
            self.rank = rank
        if world_size is not None:
            self.world_size = world_size
        zero = spec.zero
        device = "cpu"
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            device = "cuda:0"
        backend = "nccl" if self.use_gpu else "gloo"
        t_join = time.perf_counter()
        self.group = make_torch_group(backend, self.rank, self.world_size, master_addr, master_port,
                                      timeout_s=zero.collective_timeout_s, store_prefix=spec.group_name,
                                      rendezvous_timeout_s=rendezvous_timeout_s)
        # torch.distributed for the user's code, model_fn's included: a group of its own
        # ([Note: torch.distributed in user code] in comm/user_group.py)
        join_default_group(self.group, "cpu:gloo,cuda:nccl" if self.use_gpu else "gloo", zero.collective_timeout_s,
                           rendezvous_timeout_s)
        t0 = time.perf_counter()
        with self._building:  # a spare taken while warming: its throwaway build ends first (self.rank is set)
            self.engine = self.memory.build(Engine, spec.model_fn, spec.loss_fn, spec.optimizer, zero,
                                            self.group, seed=spec.seed, device=device,
                                            param_groups=spec.param_groups, scheduler=spec.scheduler)
        state_layout, state_rank = self.engine.state_layout()
        return SetupInfo(layout=self.engine.layout, state_layout=state_layout, state_rank=state_rank,
                         # keep_vars: stage 3's trainable parameters hold no values between steps
                         state_dict_keys=tuple(self.engine.model.state_dict(keep_vars=True).keys()),
                         build_s=time.perf_counter() - t0, peak_rss_bytes=self.memory.report()["peak_rss_bytes"],
                         rendezvous_s=t0 - t_join, whole_params=self.engine.whole_params)

    def _leave_group(self) -> None:
        """Drop the engine, destroy torch.distributed's default group and close the old collective
        group. The close (and the default group's last reference) goes on a thread of its own: a
        receive still posted on a broken gloo connection ends only at the group's timeout, and
        the new group must not wait for that."""
        from zeroray.comm.user_group import leave_default_group

        group, self.group, self.engine, self.feed = self.group, None, None, None
        self.snapshots.drop_staged()
        default = leave_default_group()
        gc.collect()  # the old engine's model and state, before the new one is built
        threading.Thread(target=_close_quietly, args=(group, default), daemon=True, name="zeroray-old-group").start()

    # --- training --------------------------------------------------------------------------

    @engine_call(waits_for_copy=False)
    def train_step(self, batch: Any, global_rows: Optional[int] = None) -> StepRecord:
        """One step on this rank's share of the global batch (a PackedBatch, see batch_transport.py)
        of ``global_rows`` rows ([Note: uneven splits] in engine/batch.py)."""
        return self._step(unpack(batch), global_rows)

    def _step(self, batch: Any, global_rows: Optional[int] = None) -> StepRecord:
        t_engine = time.time()
        stats = self.memory.step(self.engine.train_step, batch, before_update=self.snapshots.wait_copy,
                                 global_rows=global_rows)
        return StepRecord(stats, Hops(self._arrived.at, t_engine, time.time()))

    # --- evaluation and inference ([Note: inference calls] in engine/inference.py) --------------------

    @engine_call
    def evaluate(self, batch: Any, metric_fn: Optional[Callable]) -> Dict[str, float]:
        """``loss_fn`` (and ``metric_fn``) on this rank's share of an evaluation batch (a PackedBatch)."""
        return self.memory.step(self.engine.evaluate, unpack(batch), metric_fn)

    @engine_call
    def run(self, fn: Callable, args: Tuple[Any, ...]) -> Any:
        """``fn(model, *args)`` on this rank; the result of rank 0 only (the driver returns that one)."""
        result = self.memory.step(self.engine.run, fn, *args)
        return result if self.rank == 0 else None

    # --- Ray Data input (runtime/worker/local_feed.py; the driver's side: runtime/fit/data.py) -------------

    @engine_call
    def attach_data(self, split: Any, batch_size: int, skip: int, feed_id: str) -> SplitInfo:
        """Take this rank's split of a ray.data.Dataset and skip ``skip`` local batches."""
        from zeroray.runtime.worker.local_feed import LocalFeed

        self.feed = LocalFeed(split, batch_size, skip, feed_id)
        return self.feed.peek_info()

    @engine_call(waits_for_copy=False)
    def train_next(self) -> Optional[StepRecord]:
        """One step on this rank's next local batch; None (no step) when the split has run out."""
        if self.feed is None:
            raise RuntimeError("train_next: no Ray Data split is attached to this worker")
        batch = self.feed.take()
        return None if batch is None else self._step(batch)

    @engine_call
    def detach_data(self, feed_id: str) -> None:
        if self.feed is not None and self.feed.feed_id == feed_id:
            self.feed = None

    # --- inspection ------------------------------------------------------------------------

    @engine_call
    def master_pieces(self, names: Optional[List[str]] = None) -> Dict[str, Tuple[int, int, torch.Tensor]]:
        """(lo, hi, fp32 values) of each named parameter's flat elements this rank holds."""
        names = names if names is not None else self.engine.layout.param_names
        return {n: self.engine.master_piece(n) for n in names}

    @engine_call
    def untrained_state(self) -> Dict[str, torch.Tensor]:
        return self.engine.untrained_state()

    @engine_call
    def comm_report(self) -> CommReport:
        return CommReport(rank=self.rank, details={**self.group.counter.as_dict(), **self.engine.fetch_stats(),
                                                   **self.engine.bucket_stats()})

    @engine_call
    def memory_report(self) -> MemoryReport:
        from zeroray.memory.report import measure

        measured = measure(self.engine, self.memory.report())
        rss = current_rss_bytes()  # before snapshot_bytes' export, which may allocate copies
        return MemoryReport(rank=self.rank, rss_bytes=rss, snapshot_bytes=snapshot_bytes(self.engine),
                            details=measured)

    # --- in-memory snapshots ([Note: in-memory snapshots] in runtime/snapshot.py) -----------------

    @ray.method(concurrency_group="copy")
    def hold_copy(self, shard_refs: List[Any]) -> None:
        """A buddy's copy of another rank's snapshot shard ([Note: buddy copies]), beside any step."""
        self.snapshots.hold(shard_refs)

    def snapshot_shard(self, ticket: Ticket) -> Tuple[Any, Any, Any]:
        """fit's in-memory snapshot of this rank's state: (shard, rank 0's untrained state or None, a
        small record), three Ray objects the driver owns. Called with num_returns=3 and ``after_ok``
        behind the step it captures; not ``engine_call`` only so that a cancelled call still returns
        three values. Its turn only captures what the next step's forward may change; the state is
        exported after the turn, beside that forward, and Ray's store of it is the copy ([Note:
        overlapped snapshot copy])."""
        self._arrived.at = time.time()
        taken = self._sequencer.run(ticket, lambda: self.snapshots.capture(self.engine, self.rank))
        if isinstance(taken, Cancelled):
            return taken, None, taken
        return self.snapshots.copy_out(taken)

    @engine_call
    def stage_snapshot(self, old_layout: FlatLayout, shard_refs: List[Any], untrained_refs: List[Any]
                       ) -> Optional[str]:
        """Recovery, first half (no collective): see ``SnapshotSide.stage``."""
        return self.snapshots.stage(self.engine, old_layout, shard_refs, untrained_refs)

    @engine_call
    def apply_snapshot(self) -> int:
        """Recovery, second half: import the staged state (collective at stages 1-2)."""
        return self.snapshots.apply(self.engine)

    # --- state -----------------------------------------------------------------------------

    @engine_call
    def export_pieces(self, targets: List[Tuple[FlatLayout, int]]) -> Tuple[Any, ...]:
        """Resize, old side: one piece of this rank's state per new worker ([Note: resize transfer]),
        then a small record (the step count) the driver waits on. Called with num_returns=M+1."""
        from zeroray.runtime.worker.state_transfer import cut_pieces

        # live: cut_pieces copies what it sends, within this call's turn (no update runs beside it)
        tensors, scalars = self.engine.export_state(live=True)
        pieces = cut_pieces(self.engine.layout, self.rank, tensors, scalars, targets)
        return (*pieces, ExportDone(self.engine.step_count))

    @engine_call
    def save_shard(self, root: str, step: int) -> SavedShard:
        from zeroray.checkpoint import write_extra, write_shard

        # live: written before this call returns, within its turn (no update runs beside it)
        tensors, scalars = self.engine.export_state(live=True)
        info = write_shard(root, step, self.rank, tensors, scalars)
        extra = write_extra(root, step, self.engine.untrained_state()) if self.rank == 0 else None
        return SavedShard(info, extra, OptimizerPart(self.engine.optimizer_record()))

    @engine_call
    def optimizer_record(self) -> OptimizerPart:
        """This rank's part of the optimizer record, as built ([Note: optimizer record] in engine/optim_record.py)."""
        return OptimizerPart(self.engine.optimizer_record())

    @engine_call
    def load_checkpoint(self, path: str, optimizer_plan: Optional[OptimizerPlan] = None) -> int:
        """This rank's slices of the checkpoint, and the replicated buffers and frozen parameters
        (its extra tensors, which ``save_shard`` writes from ``untrained_state``); the optimizer's
        hyperparameters and scheduler state as ``optimizer_plan`` says ([Note: restoring the
        optimizer] in runtime/controller/optimizer_restore.py)."""
        from zeroray.checkpoint import load_extra, load_resharded
        from zeroray.engine.optim_record import with_plan

        layout, rank = self.engine.state_layout()
        tensors, scalars = load_resharded(path, layout, rank)
        if optimizer_plan is not None:
            tensors, scalars = with_plan(tensors, scalars, optimizer_plan)
        self.engine.import_state(tensors, scalars)
        self.engine.import_untrained(load_extra(path))
        return self.engine.step_count

    @engine_call
    def verify_files(self, step_dir: Any, names: List[str]) -> None:
        """Check this worker's share of a checkpoint's files (runtime/controller/restore.py)."""
        from zeroray.checkpoint import verify_files

        verify_files(step_dir, names)

    @engine_call
    def load_pieces(self, piece_refs: List[Any], untrained: Dict[str, torch.Tensor]) -> int:
        """Resize, new side: this rank's state from the old workers' pieces for it, fetched one at a
        time (the refs arrive in a list, so Ray does not fetch them all before the call), and the
        old rank 0's buffers and frozen parameters (``untrained_state``)."""
        from zeroray.runtime.worker.state_transfer import fetch_pieces

        self.engine.import_state(*fetch_pieces(self.engine.state_layout()[0], piece_refs))
        self.engine.import_untrained(untrained)
        return self.engine.step_count


def _throwaway_loss(model: torch.nn.Module, batch: Tuple[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).square().mean()


def _close_quietly(group: Any, default: Any = None) -> None:
    """Close ``group``; ``default`` (the old torch.distributed default group, already
    destroyed) is dropped here, where its teardown may wait."""
    try:
        group.close()
    except Exception:  # noqa: BLE001 - a broken group may fail to close; it is dropped either way
        pass
    del default
