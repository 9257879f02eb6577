"""Chaos run: many faults at random moments of one training run lose nothing and hang nothing.

    python benchmarks/chaos.py --cycles 50 --seed 0        # the long run (starts its own 3-node cluster)
    python benchmarks/chaos.py --cycles 4 --seed 1 --kinds step-kill,save-kill,node-loss,hang
    python benchmarks/chaos.py --cycles 50 --seed 0 --snapshot-every 1 --spares 1   # recovery from memory

It trains the main job's GPT (examples/gpt.py, made small) on a local cluster of a head and two
worker nodes (cluster/local-cluster.sh), ZeRO stage 3, 2 workers placed SPREAD, checkpoints every
``--every`` steps, ``FailureConfig(max_failures)`` far above the faults; with ``--snapshot-every``
in-memory snapshots, so a failure replaces the lost worker (a warm spare with ``--spares``) and
resumes from memory ([Note: replace, don't restart] in zeroray/runtime/worker_group/reform.py). The run is ``--cycles``
cycles of ``--steps-per-cycle`` steps; each cycle gets one fault, its kind, step and worker drawn
from ``--seed``:

- step-kill    SIGKILL of a worker inside a step (while it is in loss_fn on the chosen batch);
- save-kill    SIGKILL of a worker while it writes its shard of the chosen checkpoint;
- restore-kill a step-kill, then SIGKILL of a new worker while it reads the checkpoint back (with
               ``--snapshot-every`` the recovery reads no checkpoint: SIGKILL of the replacement
               worker as soon as it holds the rank, while the group is re-formed or the snapshot
               loaded, or in the first step after);
- node-loss    the node of a worker is lost inside a step (its ``ray start --block`` process group
               gets SIGKILL); a replacement node joins;
- hang         a worker is stopped (SIGSTOP) inside a step and resumed (SIGCONT) only after the
               collective timeout, by which time the driver has given up on it;
- resize       the trainer is resized (2 <-> 3 workers) between two steps; a resize asked for while
               fit runs is refused with a clear error.

Each fault lands at a gate (benchmarks/chaos_faults.py), so it hits the step, save or restore it
was drawn for on any machine and the seed repeats the run. At the end the run checks that
- the final weights equal those of an uninterrupted run on the same batches (same resizes,
  no faults, no checkpoints), and so do the weights of every checkpoint ``latest`` ever named,
  each of which still loads (every file read back and checked against its manifest);
- no actor or placement group of the run is left, and no worker process it ever had;
and prints faults injected / survived, steps redone, recoveries (median and p90 seconds, how many
from memory / disk, replaced / restarted) and wall time, and a JSON line.
Exit status 0 when every check holds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import torch  # noqa: E402

import gpt  # noqa: E402
from tests.local_cluster import LocalCluster, wait_until  # noqa: E402
from benchmarks.chaos_faults import ChaosStorage, fingerprint, gated_loss, latest_history  # noqa: E402
from benchmarks.common import proc_stat  # noqa: E402

KINDS = ("step-kill", "save-kill", "restore-kill", "node-loss", "hang", "resize")


@dataclass
class Fault:
    """One planned fault: its kind, the step it lands in (1-based) and the worker it hits."""

    cycle: int
    kind: str
    step: int
    rank: int
    armed: bool = False
    landed: bool = False
    survived: bool = False  # its cycle's fit completed after it
    pid: Optional[int] = None  # the worker process at the gate
    node: str = ""  # node-loss: the cluster node lost
    checkpoint: str = ""  # restore-kill: the checkpoint the recovery reads back
    note: str = ""
    thread: Optional[threading.Thread] = field(default=None, repr=False)


def plan_faults(rng: random.Random, cycles: int, kinds: List[str], steps_per_cycle: int, every: int) -> List[Fault]:
    """One fault per cycle: the first cycles go through ``kinds`` in a seeded order, then any kind."""
    order = list(kinds)
    rng.shuffle(order)
    faults, workers = [], 2
    for c in range(cycles):
        kind = order[c] if c < len(order) else rng.choice(kinds)
        first, last = c * steps_per_cycle + 1, (c + 1) * steps_per_cycle
        if kind == "save-kill":
            step = rng.choice([s for s in range(first, last + 1) if s % every == 0])
        elif kind == "restore-kill":  # needs a checkpoint before it to restore from
            step = rng.randint(max(first, every + 1), last)
        elif kind == "resize":
            step = first  # the resize happens before the cycle's first step
            workers = 3 if workers == 2 else 2
        else:
            step = rng.randint(first, last)
        faults.append(Fault(c, kind, step, rng.randrange(workers)))
    return faults


class ChaosData:
    """The global batches, re-iterable; calls ``hook(index)`` as fit fetches each (before its step is sent)."""

    def __init__(self, batches: list, hook: Callable[[int], None]) -> None:
        self.batches, self.hook = batches, hook

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            self.hook(index)
            yield batch


def _alive(pid: int) -> bool:
    try:
        return proc_stat(pid).state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Injector:
    """Arms each fault as fit fetches the batch of its step, and acts once the target is at its gate."""

    def __init__(self, trainer, cluster: LocalCluster, control: str, batches: list, faults: List[Fault],
                 collective_timeout_s: float, log: Callable[[str], None], snapshots: bool = False) -> None:
        self.trainer, self.cluster, self.control, self.batches = trainer, cluster, control, batches
        self.snapshots = snapshots  # recovery from memory: a restore-kill hits the replacement instead
        self.by_step = {f.step: f for f in faults if f.kind != "resize"}
        self.resizes = {f.step: f for f in faults if f.kind == "resize"}
        self.collective_timeout_s, self.log = collective_timeout_s, log
        self.pids: set = set()  # every worker process the run had (checked at the end)

    def seen_workers(self) -> None:
        try:
            self.pids |= {w["pid"] for w in self.trainer.workers}
        except RuntimeError:  # between groups
            pass

    def on_fetch(self, index: int) -> None:
        self.seen_workers()
        fault = self.by_step.get(index + 1)  # the step that trains on this batch
        if fault is not None and not fault.armed:
            # The gates go up here, on fit's thread, before this batch's step is sent: a gate set
            # by another thread could come up after the worker went past it.
            fault.armed = True
            try:
                self._arm(fault)
            except Exception as error:  # noqa: BLE001 - reported, and the run's checks fail on it
                fault.note = f"injector error: {type(error).__name__}: {error}"
                self._clear("loss.gate", "io.gate")
                return
            fault.thread = threading.Thread(target=self._run, args=(fault,), daemon=True)
            fault.thread.start()
        resize = self.resizes.get(index + 1)
        if resize is not None and not resize.armed:  # a resize asked for while fit runs: refused
            resize.armed = True
            self._resize_during_fit(resize)

    # --- gates --------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.control, name)

    def _write(self, name: str, text: str) -> None:
        tmp = self._path(name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self._path(name))

    def _arm_loss_gate(self, fault: Fault) -> None:
        """Worker ``fault.rank`` will wait in loss_fn on its rows of the step's batch."""
        workers = self.trainer.workers
        fault.rank %= len(workers)
        fault.pid = workers[fault.rank]["pid"]
        x = self.batches[fault.step - 1][0]
        n = x.shape[0] // len(workers)
        self._write("loss.gate", f"{fault.pid} {fingerprint(x[fault.rank * n:(fault.rank + 1) * n])}")

    def _arm(self, fault: Fault) -> None:
        """Choose the target and put up the gates of ``fault``."""
        if fault.kind == "node-loss":
            import ray

            names = self.cluster.node_names(ray.nodes())
            workers = self.trainer.workers
            off_head = [w["rank"] for w in workers if names.get(w["node_id"], "head") != "head"]
            if not off_head:
                fault.kind, fault.note = "step-kill", "every worker is on the head node: a step-kill instead"
            else:
                fault.rank = off_head[fault.rank % len(off_head)]
                fault.node = names[workers[fault.rank]["node_id"]]
        if fault.kind == "restore-kill" and not self.snapshots:  # what the recovery will read back
            fault.checkpoint = str(self.trainer.controller.last_checkpoint)
            self._write("io.gate", f"read {fault.checkpoint}/shard_")
        if fault.kind == "save-kill":
            fault.rank %= self.trainer.num_workers
            self._write("io.gate", f"write step_{fault.step:08d}/shard_{fault.rank:05d}")
        else:
            self._arm_loss_gate(fault)

    def _wait_file(self, name: str, timeout_s: float = 120.0) -> Optional[str]:
        path = self._path(name)
        if not wait_until(lambda: os.path.exists(path), timeout_s, 0.02):
            return None
        with open(path) as f:
            return f.read()

    def _clear(self, *names: str) -> None:
        for name in names:
            try:
                os.remove(self._path(name))
            except FileNotFoundError:
                pass
        for name in os.listdir(self.control):
            if name.startswith("io.taken."):
                os.remove(self._path(name))

    # --- the faults ---------------------------------------------------------------------------

    def _run(self, fault: Fault) -> None:
        try:
            getattr(self, "_" + fault.kind.replace("-", "_"))(fault)
        except Exception as error:  # noqa: BLE001 - reported, and the run's checks fail on it
            fault.note = f"injector error: {type(error).__name__}: {error}"
        finally:
            self._clear("loss.gate", "loss.blocked", "io.gate", "io.blocked")

    def _at_gate(self, fault: Fault) -> bool:
        """The target waits at its gate in the fault's step, and the driver has the step before.

        The second condition matters: the worker enters the step a moment after it finished the
        one before, and the result of that one may still be on its way to the driver; a kill
        then would fail the step before instead (on a loaded machine it does)."""
        if self._wait_file("loss.blocked") is None:
            fault.note = "the worker never reached the gate"
            return False
        return wait_until(lambda: self.trainer.step_count >= fault.step - 1, 60, 0.01)

    def _kill_at_loss_gate(self, fault: Fault) -> bool:
        if not self._at_gate(fault):
            return False
        _signal(fault.pid, signal.SIGKILL)
        fault.landed = True
        wait_until(lambda: not _alive(fault.pid), 30)
        return True

    def _step_kill(self, fault: Fault) -> None:
        if self._kill_at_loss_gate(fault):
            fault.note = "; ".join(filter(None, [fault.note, f"SIGKILL pid {fault.pid} (worker {fault.rank}) in loss_fn"]))

    def _restore_kill(self, fault: Fault) -> None:
        known = set(self.pids) | {w["pid"] for w in self.trainer.workers}  # before any replacement
        if not self._kill_at_loss_gate(fault):
            return
        if self.snapshots:
            self._kill_replacement(fault, known)
            return
        blocked = self._wait_file("io.blocked")
        if blocked is None:
            fault.landed, fault.note = False, "no worker read the checkpoint back"
            return
        pid = int(blocked.split()[0])
        _signal(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 30)
        fault.note = (f"SIGKILL pid {fault.pid} (worker {fault.rank}) in loss_fn, then pid {pid} reading "
                      f"{os.path.basename(fault.checkpoint)} back")

    def _kill_replacement(self, fault: Fault, known: set) -> None:
        """SIGKILL of the worker that takes the killed one's rank, as soon as it holds it."""
        def replacement() -> Optional[int]:
            try:
                workers = self.trainer.workers
            except RuntimeError:  # between groups
                return None
            pid = workers[fault.rank]["pid"] if fault.rank < len(workers) else None
            return pid if pid is not None and pid not in known else None
        if not wait_until(lambda: replacement() is not None, 120, 0.005):
            fault.landed, fault.note = False, "no replacement worker appeared"
            return
        pid = replacement()
        _signal(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 30)
        self.pids.add(pid)
        fault.note = f"SIGKILL pid {fault.pid} (worker {fault.rank}) in loss_fn, then pid {pid}, its replacement"

    def _save_kill(self, fault: Fault) -> None:
        blocked = self._wait_file("io.blocked")
        if blocked is None:
            fault.note = "the save never reached the gate"
            return
        pid = int(blocked.split()[0])
        _signal(pid, signal.SIGKILL)
        fault.landed = True
        wait_until(lambda: not _alive(pid), 30)
        fault.note = f"SIGKILL pid {pid} writing shard {fault.rank} of step {fault.step}"

    def _node_loss(self, fault: Fault) -> None:
        if not self._at_gate(fault):
            return
        lost_at = time.monotonic()
        self.cluster.kill_node(fault.node)
        # The worker stays at its gate until it notices that its raylet is gone and exits, as
        # it would if its machine had died inside the step; it must not finish the step first.
        gone = wait_until(lambda: not _alive(fault.pid), 120)
        exited = f"its worker exited {time.monotonic() - lost_at:.1f} s later" if gone else \
            "its worker was STILL RUNNING 120 s later"
        self._clear("loss.gate", "loss.blocked")
        added = self.cluster.add_node()
        fault.note = f"lost node {fault.node} (worker {fault.rank}; {exited}), {added} joined"
        fault.landed = gone

    def _hang(self, fault: Fault) -> None:
        pid = fault.pid
        if not self._at_gate(fault):
            return
        _signal(pid, signal.SIGSTOP)
        fault.landed = True
        self._clear("loss.gate", "loss.blocked")  # once resumed, it would go on
        time.sleep(self.collective_timeout_s + 5)
        resumed = _alive(pid)
        _signal(pid, signal.SIGCONT)
        wait_until(lambda: not _alive(pid), 60)
        fault.note = (f"SIGSTOP pid {pid} (worker {fault.rank}), SIGCONT {self.collective_timeout_s + 5:.0f} s later "
                      f"({'it was still there' if resumed else 'the driver had killed it'})")

    def _resize_during_fit(self, fault: Fault) -> None:
        """Called on fit's own thread (as fit fetches a batch), so the resize surely meets a running fit."""
        try:
            self.trainer.resize(2)
            fault.note += "; a resize during fit was NOT refused"
            fault.landed = False
        except RuntimeError as error:
            fault.note += f"; another, asked for during fit, was refused: {str(error)[:70]}"


def _state_gap(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _leftovers(job_hex: str, pids: set, timeout_s: float = 60.0) -> Dict[str, list]:
    """This job's actors not dead, its placement groups not removed, worker processes alive."""
    import ray

    def look():
        actors = [a for a, info in ray._private.state.actors().items()
                  if info["JobID"] == job_hex and info["State"] != "DEAD"]
        # A placement group's id ends with its job's id.
        groups = [g for g, info in ray.util.placement_group_table().items()
                  if g.endswith(job_hex) and info["state"] != "REMOVED"]
        return {"actors": actors, "placement_groups": groups, "processes": sorted(p for p in pids if _alive(p))}

    found = look()
    deadline = time.monotonic() + timeout_s
    while any(found.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        found = look()
    return found


def _quantile(values: List[float], q: float) -> Optional[float]:
    """The value at quantile ``q`` (nearest rank, as the median the report always gave), rounded."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _counts(keys) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


def make_trainer(zr, cfg, loss_fn, workers: int, collective_timeout_s: float, **kwargs):
    return zr.Trainer(lambda: gpt.GPT(cfg), loss_fn, optimizer=zr.AdamW(lr=3e-3),
                      zero=zr.ZeroConfig(stage=3, collective_timeout_s=collective_timeout_s),
                      scaling=zr.ScalingConfig(num_workers=workers, placement_strategy="SPREAD"), **kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--steps-per-cycle", type=int, default=4)
    p.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--snapshot-every", type=int, default=None, help="FailureConfig(snapshot_every): in-memory "
                                                                    "snapshots, replace-don't-restart recovery")
    p.add_argument("--spares", type=int, default=0, help="FailureConfig(spares): warm spare workers")
    p.add_argument("--cluster", default=None, help="DIR:HEAD_PORT:DASHBOARD_PORT of a running local-cluster.sh "
                                                   "cluster to use (default: start one, stop it at the end)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        p.error(f"--kinds: unknown {sorted(unknown)}; choose from {KINDS}")
    if args.steps_per_cycle % args.every:
        p.error("--steps-per-cycle must be a multiple of --every (every cycle starts at a checkpoint)")
    t_start = time.monotonic()
    faults = plan_faults(random.Random(args.seed), args.cycles, kinds, args.steps_per_cycle, args.every)
    total = args.cycles * args.steps_per_cycle
    say = functools.partial(print, flush=True)
    say(f"chaos: {args.cycles} cycles x {args.steps_per_cycle} steps, seed {args.seed}; faults: "
        + ", ".join(f"{f.kind}@{f.step}" for f in faults))

    if args.cluster:
        cluster_dir, head, dash = args.cluster.rsplit(":", 2)
        cluster = LocalCluster.attach(cluster_dir, int(head), int(dash))
    else:
        cluster = LocalCluster.start()
        say(f"cluster up in {time.monotonic() - t_start:.0f} s ({cluster.dir})")
    ok, report, control = False, {}, None
    try:
        os.environ.update(cluster.client_env())
        os.environ.pop("RAY_ADDRESS", None)
        import ray

        import zeroray as zr
        from zeroray.checkpoint import StoragePath, full_state_dict

        ray.init(address=cluster.gcs_address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        job_hex = ray.get_runtime_context().get_job_id()
        cfg = gpt.GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2)
        batches = list(gpt.CharBatches(batch_size=12, seq_len=cfg.seq_len, num_steps=total, seed=args.seed))
        control = tempfile.mkdtemp(prefix="zr-chaos-control-")
        root = StoragePath(ChaosStorage(control), os.path.join(control, "ckpt"))
        trainer = make_trainer(zr, cfg, functools.partial(gated_loss, control, gpt.gpt_loss), 2,
                               args.collective_timeout,
                               failure=zr.FailureConfig(max_failures=10 * args.cycles + 10,
                                                        snapshot_every=args.snapshot_every, spares=args.spares),
                               checkpoint=zr.CheckpointConfig(path=root, every_steps=args.every, keep=10**6))
        injector = Injector(trainer, cluster, control, batches, faults, args.collective_timeout, say,
                            snapshots=args.snapshot_every is not None)
        data = ChaosData(batches, injector.on_fetch)

        t_chaos = time.monotonic()
        details: List[dict] = []  # per recovery: the fault's kind and the recovery record's phases
        try:
            for fault in faults:
                if fault.kind == "resize":
                    target = 3 if trainer.num_workers == 2 else 2
                    trainer.resize(target)
                    fault.landed = True
                    fault.note = f"resized to {target} workers"
                before = len(trainer.recoveries)
                trainer.fit(data, num_steps=args.steps_per_cycle, progress=False)
                if fault.thread is not None:
                    fault.thread.join(600)
                fault.survived = fault.landed
                injector.seen_workers()
                recs = trainer.recoveries[before:]
                details += [{"kind": fault.kind, "cause": r["cause"].split(":")[0],
                             **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                if k not in ("cause", "detected_at", "resumed_at")}} for r in recs]
                say(f"  cycle {fault.cycle:3d} {fault.kind:12s} step {fault.step:4d}: "
                    f"{'landed' if fault.landed else 'DID NOT LAND'}; {fault.note}; "
                    + (", ".join(f"recovered to step {r['step']} ({r['redone_steps']} redone) in {r['seconds']:.1f} s "
                                 f"({r['cause'].split(':')[0]}; {r.get('mode', 'restart')}, from "
                                 f"{r.get('restored_from', '?')})" for r in recs) or "no recovery"))
        except Exception as error:  # noqa: BLE001 - the run failed: say how far it got
            say(f"chaos: training failed at step {trainer.step_count}: {type(error).__name__}: {error}")
            report = {"failed": f"{type(error).__name__}: {str(error)[:500]}", "step": trainer.step_count,
                      "faults_injected": sum(f.landed for f in faults), "faults_survived": sum(f.survived for f in faults)}
            trainer.shutdown()
            raise
        chaos_s = time.monotonic() - t_chaos
        final = trainer.state_dict()
        recoveries = list(trainer.recoveries)
        assert trainer.step_count == total, (trainer.step_count, total)
        trainer.shutdown()

        # The uninterrupted run: same batches and resizes, no faults, no checkpoints.
        t_ref = time.monotonic()
        wanted: Dict[int, Dict[str, torch.Tensor]] = {}
        with make_trainer(zr, cfg, gpt.gpt_loss, 2, args.collective_timeout) as reference:
            for fault in faults:
                if fault.kind == "resize":
                    reference.resize(3 if reference.num_workers == 2 else 2)
                for _ in range(args.steps_per_cycle // args.every):
                    reference.fit(batches, num_steps=args.every, progress=False)
                    wanted[reference.step_count] = reference.state_dict()
            injector.pids |= {w["pid"] for w in reference.workers}
        ref_s = time.monotonic() - t_ref

        gap = _state_gap(final, wanted[total])
        history = latest_history(control)
        checkpoint_gaps = {}
        for step_dir in dict.fromkeys(history):  # every checkpoint latest ever named, once
            state = full_state_dict(step_dir)  # reads every file back, checked against the manifest
            step = int(os.path.basename(step_dir).split("_")[1])
            checkpoint_gaps[os.path.basename(step_dir)] = _state_gap({k: state[k] for k in final}, wanted[step])
        left = _leftovers(job_hex, injector.pids)
        injected = [f for f in faults if f.landed]
        survived = [f for f in faults if f.survived]
        redone = sum(r.get("redone_steps", 0) for r in recoveries)
        worst_checkpoint = max(checkpoint_gaps.values(), default=0.0)
        report = {"cycles": args.cycles, "seed": args.seed, "faults_planned": len(faults),
                  "faults_injected": len(injected), "faults_survived": len(survived),
                  "by_kind": {k: sum(f.kind == k for f in injected) for k in kinds},
                  "recoveries": len(recoveries), "steps_redone": redone, "steps": total,
                  "final_max_abs_diff": gap, "checkpoints_latest_named": len(history),
                  "checkpoints_verified": len(checkpoint_gaps), "checkpoint_max_abs_diff": worst_checkpoint,
                  "leftovers": left, "wall_s": round(time.monotonic() - t_start, 1),
                  "chaos_fit_s": round(chaos_s, 1), "reference_s": round(ref_s, 1),
                  "recovery_s_median": _quantile([r["seconds"] for r in recoveries], 0.5),
                  "recovery_s_p90": _quantile([r["seconds"] for r in recoveries], 0.9),
                  "recoveries_by_mode": _counts(r.get("mode", "restart") for r in recoveries),
                  "recoveries_from": _counts(r.get("restored_from", "?") for r in recoveries),
                  "redone_per_fault": round(redone / max(1, len(injected)), 3),
                  "snapshot_every": args.snapshot_every, "spares": args.spares,
                  "recovery_details": details}
        ok = (len(survived) == len(faults) and gap <= 1e-6 and worst_checkpoint <= 1e-6
              and not any(left.values()) and len(checkpoint_gaps) > 0)
        say(f"faults injected {len(injected)} / planned {len(faults)}, survived {len(survived)}; "
            f"recoveries {len(recoveries)} (median {report['recovery_s_median']} s, p90 {report['recovery_s_p90']} s; "
            f"{report['recoveries_by_mode']}, from {report['recoveries_from']}); steps redone {redone} (of {total}); "
            f"final weights vs uninterrupted: max |diff| {gap:.3g}; "
            f"{len(checkpoint_gaps)} checkpoints latest named all load, max |diff| vs uninterrupted "
            f"{worst_checkpoint:.3g}; left: {left}; wall {report['wall_s']:.0f} s "
            f"(chaos fit {chaos_s:.0f} s, uninterrupted run {ref_s:.0f} s)")
    except Exception:
        import traceback

        traceback.print_exc()
    finally:
        problem = cluster.close()
        if problem:
            say(problem)
            ok = False
    report["ok"] = ok
    if ok and control:
        shutil.rmtree(control, ignore_errors=True)  # kept for the post-mortem otherwise
    say("CHAOS_REPORT " + json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
