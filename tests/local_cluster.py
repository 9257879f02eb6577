"""A cluster/local-cluster.sh cluster, a head and worker nodes on this machine, for the tests
that need a real multi-node Ray (tests/e2e: the chaos run, job submission) and for the scripts
they run (benchmarks/chaos.py, benchmarks/driver_death.py import it from here).

Each node is a ``ray start --block`` in a process group of its own, recorded by the script; a
node is lost by SIGKILL to that group (``local-cluster.sh kill-node``) and replaced by a new
one (``add-node``). Nothing here signals a process by name and nothing runs ``ray stop``: only
the groups the script started are ever ended.

The cluster runs with fast node failure detection (the GCS checks each raylet every 500 ms and
gives up after 3 misses): a lost node must not hold its resources for Ray's default half
minute, during which a restarted group could be placed on it.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "local-cluster.sh"
FAST_FAILURE_DETECTION = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def free_cluster_port(taken: set) -> int:
    """A free port below Linux's ephemeral range (32768-60999): Ray binds its other ports
    (node manager, object manager, agents, workers) to port 0, i.e. in that range, while
    the cluster starts, so a port picked there could be taken before the dashboard binds."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in taken:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


class LocalCluster:
    """A local-cluster.sh cluster in a directory of its own: start or attach, lose and add nodes, stop."""

    def __init__(self, cluster_dir: str, head_port: int, dashboard_port: int, owned: bool) -> None:
        self.dir, self.head_port, self.dashboard_port, self.owned = cluster_dir, head_port, dashboard_port, owned
        self.stopped = False  # by stop(): a second stop() (a shared cluster's last user, then its owner) is a no-op
        env = dict(os.environ)
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(name, None)
        env.update(FAST_FAILURE_DETECTION, ZR_CLUSTER_DIR=cluster_dir, ZR_HEAD_PORT=str(head_port),
                   ZR_DASHBOARD_PORT=str(dashboard_port), PYTHON=sys.executable,
                   PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
        self.env = env
        self.next_worker = 1 + max([int(p.stem[6:]) for p in Path(cluster_dir, "pgid").glob("worker*.pgid")] or [0])

    @classmethod
    def start(cls, num_worker_nodes: int = 2, node_cpus: int = 2) -> "LocalCluster":
        cluster_dir = tempfile.mkdtemp(prefix="zr-chaos-", dir="/tmp")  # short: Ray's socket paths live under it
        taken: set = set()
        cluster = cls(cluster_dir, free_cluster_port(taken), free_cluster_port(taken), owned=True)
        cluster.env.update(ZR_NUM_WORKER_NODES=str(num_worker_nodes), ZR_NODE_CPUS=str(node_cpus))
        out = cluster._run("up", timeout=600)
        if out.returncode != 0:
            cluster._run("down", timeout=120)
            raise RuntimeError(f"local-cluster.sh up failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        cluster.next_worker = num_worker_nodes + 1
        return cluster

    @classmethod
    def attach(cls, cluster_dir: str, head_port: int, dashboard_port: int) -> "LocalCluster":
        """A cluster someone else started (and stops): e.g. a test's fixture."""
        return cls(cluster_dir, head_port, dashboard_port, owned=False)

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.head_port}"

    def client_env(self) -> Dict[str, str]:
        """What a driver of this cluster needs in its environment (token authentication)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": os.path.join(self.dir, "auth_token")}

    def _run(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], env=self.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)

    def node_names(self, ray_nodes: List[dict]) -> Dict[str, str]:
        """Ray node id -> this cluster's node name (head, workerN), from each raylet's temp dir."""
        names = {}
        for node in ray_nodes:
            socket_path = node.get("RayletSocketName", "")
            temp = socket_path.split("/session_")[0]
            short = os.path.basename(temp)
            if temp.startswith(self.dir):
                names[node["NodeID"]] = "head" if short == "h" else f"worker{short[1:]}"
        return names

    def kill_node(self, name: str) -> None:
        out = self._run("kill-node", name, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"kill-node {name} failed: {out.stdout}{out.stderr}")

    def add_node(self) -> str:
        name = f"worker{self.next_worker}"
        self.next_worker += 1
        out = self._run("add-node", name, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"add-node {name} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        return name

    def stop(self) -> Optional[str]:
        """Stop the cluster if this object started it (and has not stopped it); the script's complaint, if any."""
        if not self.owned or self.stopped:
            return None
        out = self._run("down", timeout=180)
        if out.returncode == 0:
            self.stopped = True
            shutil.rmtree(self.dir, ignore_errors=True)
            return None
        return f"local-cluster.sh down: {out.stdout[-2000:]}{out.stderr[-2000:]} (state kept in {self.dir})"

    def close(self) -> Optional[str]:
        """End this driver's Ray connection, then stop the cluster; the script's complaint, if any."""
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            problem = self.stop()
        return problem


def wait_until(condition, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
