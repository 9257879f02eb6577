"""Shared fixtures: one local Ray for the whole session (actors start in seconds, Ray in ~10 s),
and a tiny real file system for full-disk errors."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        # Oversubscribed on purpose: 3-4 workers must fit on a 2-core machine.
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 64 KiB file system (a tmpfs; the test is skipped where mounting is not allowed):
    the place to see what a full disk does."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)
