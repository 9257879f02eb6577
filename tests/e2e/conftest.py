"""The cluster test_chaos.py and test_elastic_resume.py share: one cluster/local-cluster.sh start-up
(a head and two worker nodes, ~15 s on an idle 2-core machine) for both modules, which run one
after the other. Neither needs a fresh cluster: the chaos run ends by checking that nothing of
it is left (no actor, placement group or worker process), and it leaves a head and two worker
nodes alive (a lost node is replaced). test_job_submission.py starts and stops its own, since
``local-cluster.sh up`` and ``down`` are what it tests."""
import pytest

from tests.local_cluster import LocalCluster


@pytest.fixture(scope="package")
def shared_cluster():
    """Started by its first user; test_elastic_resume.py, the last, stops it when it is done (so it
    does not idle beside the next modules' Ray), and this stops it otherwise. ``local-cluster.sh
    down`` must find nothing left of it."""
    cluster = LocalCluster.start(num_worker_nodes=2, node_cpus=2)
    try:
        yield cluster
    finally:
        problem = cluster.stop()
        assert problem is None, problem
