"""End to end: the README's "A job on a Ray cluster" commands, as written: examples/train_gpt.py
submitted as a Ray job to a three-node cluster.

The commands are read from the README (tests/readme_commands.py) and run by bash in the
repository root: ``local-cluster.sh up``, ``eval "$(... env)"`` and ``ray job submit`` in one
shell, ``down`` at the end. The cluster is cluster/local-cluster.sh (a head and two worker nodes
on this machine, token authentication on); the test's environment (ZR_CLUSTER_DIR, ports) puts it
in a temp dir of its own and on free ports, so it neither touches nor is touched by another Ray
instance here (a test's embedded Ray, someone else's cluster). The job is the README's: the main
job's defaults (stage 3, 150 steps) with two workers placed SPREAD, and its log must show the two
workers on two different nodes and the run's last loss.

Everything is driven through subprocesses, never through the Ray client in this
process: the job client's token and RAY_AUTH_MODE would otherwise leak into the Ray
state of other tests in the same pytest session.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.local_cluster import free_cluster_port
from tests.readme_commands import ways_to_run, without_comment

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO_ROOT / "cluster" / "local-cluster.sh"

# The README's commands: up, eval "$(... env)", ray job submit (the working dir is zipped and sent
# to every node; Ray 2.60's client also honours .gitignore), down.
UP, ENV, SUBMIT, DOWN = ways_to_run()["A job on a Ray cluster"]
# The line examples/train_gpt.py prints per worker: `worker {rank} on node {node_id_hex} ({ip})`.
WORKER_LINE = re.compile(r"worker (\d+) on node ([0-9a-f]+) \(([^)\s]*)\)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A line of `local-cluster.sh status`: node id, ip, state, resources.
ALIVE_NODE = re.compile(r"^([0-9a-f]{56}) +\S+ +ALIVE", re.MULTILINE)

UP_TIMEOUT_S = 300  # about 30-60 s on an idle 2-core machine, 3 min when it is loaded
JOB_TIMEOUT_S = 900  # the main job's 150 steps: about 1-2 min on an idle 2-core machine
DOWN_TIMEOUT_S = 90

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local-cluster.sh needs Linux"),
    pytest.mark.skipif(shutil.which("setsid") is None, reason="local-cluster.sh needs setsid"),
]


def _cluster_env(cluster_dir: str, head_port: int, dashboard_port: int) -> dict[str, str]:
    env = dict(os.environ)
    # Whatever Ray this pytest session points at is not the cluster under test.
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        ZR_CLUSTER_DIR=cluster_dir,
        ZR_HEAD_PORT=str(head_port),
        ZR_DASHBOARD_PORT=str(dashboard_port),
        ZR_UP_TIMEOUT=str(UP_TIMEOUT_S - 40),
        PYTHON=sys.executable,
        PATH=bin_dir + os.pathsep + env.get("PATH", ""),
    )
    return env


def _client_env(cluster_env: dict[str, str], cluster_dir: str) -> dict[str, str]:
    """What `ray job ...` needs: the cluster's token (see [Note: token auth] in the script)."""
    return dict(cluster_env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=f"{cluster_dir}/auth_token")


def _cluster(cmd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), cmd],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )


def _bash(script: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """README lines, as written, in one bash in the repository root (as a user types them)."""
    return subprocess.run(["bash", "-c", "set -e\n" + script], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _ray_cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    ray_bin = shutil.which("ray", path=env["PATH"])
    assert ray_bin, "the `ray` command is not on PATH"
    return subprocess.run(
        [ray_bin, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )


def _recorded_pgids(cluster_dir: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(Path(cluster_dir, "pgid").glob("*.pgid"))]


def _live_members(pgids: list[int], cluster_dir: str) -> dict[int, tuple[str, bool]]:
    """Processes still alive from the cluster: in a recorded process group, or carrying
    the script's ZR_LOCAL_CLUSTER_ID marker in their environment (Ray workers and job
    drivers leave the node's process group). pid -> (command line, carries the marker)."""
    id_file = Path(cluster_dir, "cluster_id")
    marker = f"ZR_LOCAL_CLUSTER_ID={id_file.read_text().strip()}".encode() if id_file.exists() else None
    left = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            # Fields after the ")" that ends the command name: state ppid pgrp ...
            state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if state == "Z":
                continue
            in_group = int(pgrp) in pgids
            marked = marker is not None and marker in (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if in_group or marked:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
            left[int(proc.name)] = (cmdline.decode(errors="replace"), marked)
    return left


def _diagnostics(cluster_dir: str) -> str:
    out = []
    for log in sorted(Path(cluster_dir, "logs").glob("*.log")):
        out.append(f"--- {log.name} (tail) ---\n" + "\n".join(log.read_text().splitlines()[-20:]))
    return "\n".join(out)


def test_readme_cluster_job_spreads_workers_over_nodes():
    assert (without_comment(UP), without_comment(DOWN)) == ("bash cluster/local-cluster.sh up",
                                                            "bash cluster/local-cluster.sh down")
    assert "ray job submit" in SUBMIT and "local-cluster.sh env" in ENV
    # Short path on purpose: Ray's unix socket paths live under it (107-byte limit).
    cluster_dir = tempfile.mkdtemp(prefix="zr-e2e-", dir="/tmp")
    taken: set[int] = set()
    head_port, dashboard_port = free_cluster_port(taken), free_cluster_port(taken)
    env = _cluster_env(cluster_dir, head_port, dashboard_port)
    client_env = _client_env(env, cluster_dir)
    address = f"http://127.0.0.1:{dashboard_port}"
    pgids: list[int] = []
    passed = submitted = False
    started = time.monotonic()
    try:
        up = _bash(UP, env, timeout=UP_TIMEOUT_S)
        pgids = _recorded_pgids(cluster_dir)
        assert up.returncode == 0, f"up failed:\n{up.stdout}\n{up.stderr}\n{_diagnostics(cluster_dir)}"
        assert len(pgids) == 3, pgids
        assert address in up.stdout and "ray job submit" in up.stdout, up.stdout
        up_s = time.monotonic() - started

        status = _cluster("status", env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        node_ids = set(ALIVE_NODE.findall(status.stdout))
        assert len(node_ids) == 3, status.stdout

        submitted = True
        submit = _bash(f"{ENV}\n{SUBMIT}", env, timeout=JOB_TIMEOUT_S)  # the job's log streams to its stdout
        log = ANSI.sub("", submit.stdout)
        report = f"submit rc={submit.returncode}\n{log[-6000:]}\n{submit.stderr[-4000:]}"
        assert submit.returncode == 0 and re.search(r"Job '\S+' succeeded", log), report

        workers = {int(rank): node for rank, node, _ip in WORKER_LINE.findall(log)}
        assert set(workers) == {0, 1}, report
        assert workers[0] != workers[1], f"SPREAD put both workers on node {workers[0]}\n{report}"
        assert {workers[0], workers[1]} <= node_ids, (workers, node_ids)
        last = re.search(r"steps 1-150: first loss ([\d.]+), last loss \(mean of last 10 steps\) ([\d.]+)", log)
        assert last and float(last.group(2)) < float(last.group(1)) - 2.0, report  # it trained: 5.5 -> 2.7
        print(f"cluster up in {up_s:.0f}s, job done at {time.monotonic() - started:.0f}s: {last.group(0)}")
        passed = True
    except subprocess.TimeoutExpired as timeout:
        if submitted:  # the README's submit names no job: find it in what it printed
            printed = timeout.stdout.decode(errors="replace") if isinstance(timeout.stdout, bytes) else timeout.stdout
            for job in set(re.findall(r"raysubmit_\w+", printed or "")):
                _ray_cli(["job", "stop", "--address", address, job], client_env, 60)
        raise
    finally:
        down = _bash(DOWN, env, timeout=DOWN_TIMEOUT_S)
        pgids = pgids or _recorded_pgids(cluster_dir)
        left = _live_members(pgids, cluster_dir)
        # Do not leave them running for the next test, then fail. Only marked processes
        # are killed: a pid is only known to be ours if it carries this cluster's id.
        for pid, (_cmd, marked) in left.items():
            if marked:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if passed and not left:
            shutil.rmtree(cluster_dir, ignore_errors=True)
        else:  # keep the Ray logs (r/<node>/session_latest/logs) for the post-mortem
            print(f"cluster state and logs kept in {cluster_dir}")
        assert down.returncode == 0, f"down failed:\n{down.stdout}\n{down.stderr}"
        assert not left, "processes left after down:\n" + "\n".join(
            f"{pid}: {cmd}" for pid, (cmd, _marked) in left.items())
