"""The driver dies mid-fit (SIGKILL): its workers and placement group go with it, and a restore goes on.

    python benchmarks/driver_death.py                 # starts its own local 3-node cluster
    python benchmarks/driver_death.py --cluster DIR:HEAD_PORT:DASHBOARD_PORT

A child driver process (this script with ``--child``) connects to the local cluster
(cluster/local-cluster.sh), trains the main job's GPT (examples/gpt.py, small) with ZeRO stage 3
on 2 workers, checkpoints every 2 steps, and stops inside step ``--kill-at``: worker 0 waits at a
gate in loss_fn (benchmarks/chaos_faults.py). This process, a second driver on the same cluster,
then SIGKILLs the child and polls the GCS tables until no actor of the child's job is alive, its
placement group is removed and its worker processes are gone, and reports the seconds each took.
Then it restores from the checkpoint root (``Trainer.restore``), trains to the end, and compares
the weights with an uninterrupted run on the same batches. Prints a JSON line; exit status 0 when
everything was released and the weights are equal.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import gpt  # noqa: E402
from tests.local_cluster import LocalCluster, wait_until  # noqa: E402
from benchmarks.chaos_faults import fingerprint, gated_loss  # noqa: E402
from benchmarks.common import proc_stat  # noqa: E402

CFG = gpt.GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2)
EVERY = 2


def _batches(steps: int) -> list:
    return list(gpt.CharBatches(batch_size=12, seq_len=CFG.seq_len, num_steps=steps, seed=0))


def _trainer(zr, loss_fn, **kwargs):
    return zr.Trainer(lambda: gpt.GPT(CFG), loss_fn, optimizer=zr.AdamW(lr=3e-3), zero=zr.ZeroConfig(stage=3),
                      scaling=zr.ScalingConfig(num_workers=2, placement_strategy="SPREAD"), **kwargs)


def child(args) -> int:
    """The driver that dies: trains until worker 0 waits in step --kill-at, then waits to be killed."""
    import ray

    import zeroray as zr

    ray.init(address=args.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    batches = _batches(args.steps)
    trainer = _trainer(zr, functools.partial(gated_loss, args.control, gpt.gpt_loss),
                       checkpoint=zr.CheckpointConfig(path=os.path.join(args.control, "ckpt"), every_steps=EVERY))
    group = trainer.controller.group
    info = {"job": ray.get_runtime_context().get_job_id(), "pid": os.getpid(),
            "actors": [a._actor_id.hex() for a in group.actors], "placement_group": group.pg.id.hex(),
            "worker_pids": [w["pid"] for w in trainer.workers]}
    x = batches[args.kill_at - 1][0]
    with open(os.path.join(args.control, "loss.gate"), "w") as f:  # worker 0's rows of that step
        f.write(f"{info['worker_pids'][0]} {fingerprint(x[:x.shape[0] // 2])}")
    with open(os.path.join(args.control, "child.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(args.control, "child.json.tmp"), os.path.join(args.control, "child.json"))
    trainer.fit(batches, progress=False)  # never returns: the parent kills this process inside it
    return 1


def _alive(pid: int) -> bool:
    try:
        return proc_stat(pid).state != "Z"
    except FileNotFoundError:
        return False


def parent(args) -> int:
    t_start = time.monotonic()
    if args.cluster:
        cluster_dir, head, dash = args.cluster.rsplit(":", 2)
        cluster = LocalCluster.attach(cluster_dir, int(head), int(dash))
    else:
        cluster = LocalCluster.start()
    report, ok, control = {}, False, None
    child_proc = None
    try:
        os.environ.update(cluster.client_env())
        os.environ.pop("RAY_ADDRESS", None)
        import ray

        import zeroray as zr

        control = tempfile.mkdtemp(prefix="zr-driver-death-")
        child_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--control", control,
                                       "--address", cluster.gcs_address, "--steps", str(args.steps),
                                       "--kill-at", str(args.kill_at)],
                                      stdout=subprocess.DEVNULL, stderr=open(os.path.join(control, "child.log"), "w"))
        ray.init(address=cluster.gcs_address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        blocked = os.path.join(control, "loss.blocked")
        if not wait_until(lambda: os.path.exists(blocked) or child_proc.poll() is not None, 600):
            raise RuntimeError("the child driver never reached step --kill-at")
        if child_proc.poll() is not None:
            raise RuntimeError(f"the child driver exited ({child_proc.returncode}): "
                               + open(os.path.join(control, "child.log")).read()[-3000:])
        with open(os.path.join(control, "child.json")) as f:
            info = json.load(f)
        latest = open(os.path.join(control, "ckpt", "latest")).read().strip()

        def actors_left():
            table = ray._private.state.actors()
            return sorted({a for a in info["actors"] if table.get(a, {}).get("State") != "DEAD"}
                          | {a for a, t in table.items() if t["JobID"] == info["job"] and t["State"] != "DEAD"})

        def group_left():
            return ray.util.placement_group_table().get(info["placement_group"], {}).get("state", "REMOVED") != "REMOVED"

        alive_before = {"actors": len(actors_left()), "placement_group": group_left(),
                        "worker_processes": sum(_alive(p) for p in info["worker_pids"])}
        child_proc.send_signal(signal.SIGKILL)  # the driver dies: no shutdown(), no finalizer, nothing
        killed_at = time.monotonic()
        child_proc.wait()
        os.remove(os.path.join(control, "loss.gate"))  # nothing else should ever wait there

        seconds = {}
        for name, left in (("actors", actors_left), ("placement_group", group_left),
                           ("worker_processes", lambda: [p for p in info["worker_pids"] if _alive(p)])):
            wait_until(lambda: not left(), 120, 0.05)
            seconds[name] = round(time.monotonic() - killed_at, 2) if not left() else None

        # The restore from the checkpoint the dead driver left, trained to the end.
        root = os.path.join(control, "ckpt")
        batches = _batches(args.steps)
        with zr.Trainer.restore(root, lambda: gpt.GPT(CFG), gpt.gpt_loss, optimizer=zr.AdamW(lr=3e-3),
                                zero=zr.ZeroConfig(stage=3),
                                scaling=zr.ScalingConfig(num_workers=2, placement_strategy="SPREAD")) as restored:
            resumed_at = restored.step_count
            restored.fit(batches, progress=False)
            state = restored.state_dict()
        with _trainer(zr, gpt.gpt_loss) as reference:
            reference.fit(batches, progress=False)
            want = reference.state_dict()
        gap = max((state[k] - want[k]).abs().max().item() for k in want)
        report = {"alive_before_the_kill": alive_before, "seconds_until_no_actor": seconds["actors"],
                  "seconds_until_placement_group_removed": seconds["placement_group"],
                  "seconds_until_worker_processes_gone": seconds["worker_processes"],
                  "latest_when_killed": latest, "killed_in_step": args.kill_at, "restored_at_step": resumed_at,
                  "steps": args.steps, "final_max_abs_diff": gap, "wall_s": round(time.monotonic() - t_start, 1)}
        ok = all(v is not None for v in seconds.values()) and alive_before == {
            "actors": 2, "placement_group": True, "worker_processes": 2} and gap <= 1e-6 and resumed_at == int(latest.split("_")[1])
        print(f"driver SIGKILLed inside step {args.kill_at}: no actor left after {seconds['actors']} s, placement "
              f"group removed after {seconds['placement_group']} s, worker processes gone after "
              f"{seconds['worker_processes']} s; restored {latest} and trained to step {args.steps}: max |diff| vs "
              f"uninterrupted {gap:.3g}", flush=True)
    except Exception:
        import traceback

        traceback.print_exc()
    finally:
        if child_proc is not None and child_proc.poll() is None:
            child_proc.kill()
        problem = cluster.close()
        if problem:
            print(problem, flush=True)
            ok = False
    report["ok"] = ok
    if ok and control:
        shutil.rmtree(control, ignore_errors=True)  # kept for the post-mortem otherwise
    print("DRIVER_DEATH_REPORT " + json.dumps(report), flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=5, help="the step (1-based) inside which the driver dies")
    p.add_argument("--cluster", default=None, help="DIR:HEAD_PORT:DASHBOARD_PORT of a running local-cluster.sh cluster")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
