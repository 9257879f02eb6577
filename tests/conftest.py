"""Shared fixtures: one local Ray for the whole session (actors start in seconds, Ray in ~10 s)."""
import os
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
