"""The import-linter contracts of pyproject.toml hold, and a broken one is caught.

The contracts are the layers of docs/architecture.md ("layers", with tune/ and tracking/ above
runtime/), "only runtime (and the Tune integration above it) imports ray",
"comm knows nothing of models", "no cycles between sibling modules", the packages inside runtime/
("runtime-layers"), "the worker side never imports the driver's packages", "tests import no
benchmark" and "plan simulates on paper". They are checked by
``lint-imports`` itself, run here as a subprocess from the repository root, rather than by a
hand-written walk over the imports: import-linter reads the whole import graph (function-level
imports too) and names the import chain that breaks a contract.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="the test extras install import-linter")

ROOT = Path(__file__).resolve().parents[2]
# contract id -> the name lint-imports reports it by
NAMES = {c["id"]: c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
CONTRACTS = list(NAMES)
# The contracts that hold on this branch; the others are expected to fail until their fix is merged.
PENDING: dict = {}  # contract id -> why it is expected to fail for now (none)


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``root`` (that copy, not whichever zeroray is installed),
    limited to ``contracts``; no cache is written into the tree."""
    args = [arg for contract in contracts for arg in ("--contract", contract)]
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_contracts_are_the_ones_the_docs_describe():
    assert CONTRACTS == ["layers", "ray-in-runtime", "comm-no-models", "no-cycles", "runtime-layers",
                         "worker-not-driver", "tests-no-benchmarks", "plan-pure"]


@pytest.mark.parametrize("contract", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=PENDING[c])) if c in PENDING else c
    for c in CONTRACTS
])
def test_contract_is_kept(contract):
    out = lint_imports(ROOT, contract)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{NAMES[contract]} KEPT" in out.stdout and "1 kept, 0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize("module, line, contract, chain", [
    # Ray reaches down into comm: every layer above comm now imports ray through it.
    ("zeroray/comm/waiter.py", "import ray", "ray-in-runtime", "zeroray.comm.waiter -> ray"),
    # An upward import: the layout (below comm) reaching into the engine.
    ("zeroray/layout/arena.py", "from zeroray.engine import engine", "layers",
     "zeroray.layout.arena -> zeroray.engine.engine"),
    # comm learning about models: the wrap policy is the layout's business, not the collectives'.
    ("zeroray/comm/gather.py", "from zeroray.layout import wrap", "comm-no-models",
     "zeroray.comm.gather -> zeroray.layout.wrap"),
    # runtime reaching up into a tracker: a worker could then import TensorBoard (tracking/ is above runtime/).
    ("zeroray/runtime/fit/callbacks.py", "from zeroray.tracking import scalars", "layers",
     "zeroray.runtime.fit.callbacks -> zeroray.tracking.scalars"),
    # The controller driving fit: fit drives the controller through its public methods, not back.
    ("zeroray/runtime/controller/policy.py", "from zeroray.runtime.fit import loop", "runtime-layers",
     "zeroray.runtime.controller.policy -> zeroray.runtime.fit.loop"),
    # The worker side learning of the driver's step pipeline.
    ("zeroray/runtime/worker/local_feed.py", "from zeroray.runtime.execution import pipeline", "worker-not-driver",
     "zeroray.runtime.worker.local_feed -> zeroray.runtime.execution.pipeline"),
    # A test reaching into a benchmark script for a helper (what tests/unit/test_gpu.py once did).
    ("tests/unit/test_gpu.py", "from benchmarks.gpu_check import main", "tests-no-benchmarks",
     "tests.unit.test_gpu -> benchmarks.gpu_check"),
])
def test_a_broken_contract_fails_and_names_the_import(tmp_path, module, line, contract, chain):
    for package in ("zeroray", "tests", "benchmarks"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}\n")
    out = lint_imports(tmp_path, *(c for c in CONTRACTS if c not in PENDING))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{NAMES[contract]} BROKEN" in out.stdout, out.stdout
    assert chain in out.stdout, out.stdout
