"""FailurePolicy, ScalingPolicy and the error classification, without a cluster."""
import pytest
import ray.exceptions as rex

from zeroray.errors import StepError
from zeroray.errors import CollectiveError, PeerStepError
from zeroray.runtime.failures import (CollectiveTimeoutError, ErrorKind, WorkerDiedError, WorkerError,
                                      WorkerGroupError, WorkerTraceback, classify_error, is_worker_failure,
                                      worker_error)
from zeroray.runtime.controller.policy import Action, FailurePolicy, ScalingPolicy


def _task_error(cause: BaseException) -> BaseException:
    """What ray.get raises for an exception inside a worker: RayTaskError(<cause type>)."""
    return rex.RayTaskError("Worker.train_step", f"Traceback ...\n{type(cause).__name__}: {cause}",
                            cause).as_instanceof_cause()


def test_failure_policy_restarts_until_max_failures_then_raises():
    policy = FailurePolicy(max_failures=2)
    died = WorkerDiedError("step 5: worker(s) [1] died", [1])
    first = policy.on_failure(died, user_error=False)
    assert first.action is Action.RESTART and "worker failure 1 of at most 2" in first.reason
    assert "WorkerDiedError: step 5" in first.reason
    assert policy.on_failure(died, user_error=False).action is Action.RESTART
    last = policy.on_failure(died, user_error=False)
    assert last.action is Action.RAISE and policy.exhausted
    assert "3 worker failure(s)" in last.reason and "max_failures=2" in last.reason


def test_failure_policy_zero_failures_raises_at_once():
    policy = FailurePolicy(max_failures=0)
    assert policy.on_failure(RuntimeError("x"), user_error=False).action is Action.RAISE
    assert policy.exhausted


def test_user_errors_are_never_retried_nor_counted():
    policy = FailurePolicy(max_failures=5)
    decision = policy.on_failure(ValueError("bad batch"), user_error=True)
    assert decision.action is Action.RAISE and "user code or input" in decision.reason
    assert policy.failures == 0 and not policy.exhausted


@pytest.mark.parametrize("error, kind", [
    (rex.ActorDiedError(), "died"),
    (rex.RayActorError(), "died"),
    (WorkerDiedError("gone", [0]), "died"),
    (CollectiveTimeoutError("stuck", [1]), "timeout"),
    (WorkerGroupError("lost a peer", [1]), "peer"),
    (_task_error(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:49559: "
                              "Connection reset by peer. This is typically caused by a remote worker")), "peer"),
    (_task_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234")),
     "peer"),
    (_task_error(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for send "
                              "operation to complete")), "timeout"),
    (_task_error(StepError("step 3: loss_fn returned a non-finite loss (nan)")), "user"),
    (_task_error(ValueError("shapes do not match")), "user"),
    (ValueError("the global batch has 13 rows"), "user"),
    (RuntimeError("some bug"), "user"),
    (_task_error(PeerStepError("step 3 was not applied: worker 1 failed", [1])), "peer_step"),
    (_task_error(CollectiveError("all_gather: the peer closed the connection")), "peer"),
    (_task_error(CollectiveError("all_gather timed out after 5 s")), "timeout"),
])
def test_classify_error(error, kind):
    assert classify_error(error) is ErrorKind(kind)
    assert is_worker_failure(error) == (kind in ("died", "peer", "timeout"))


def test_classify_looks_at_the_worker_error_not_its_traceback():
    # User code whose traceback mentions a peer, but whose own error is a plain bug.
    error = rex.RayTaskError("Worker.train_step", "File x, in connect_to_peer\n  Connection reset by peer?\n"
                             "KeyError: 'labels'", KeyError("labels")).as_instanceof_cause()
    assert classify_error(error) is ErrorKind.USER


def test_worker_error_is_the_workers_own_exception_message_first():
    error = rex.RayTaskError("Worker.train_step", "Traceback (most recent call last):\n  File \"loss.py\", "
                             "line 3, in loss_fn\nKeyError: 'labels'", KeyError("labels")).as_instanceof_cause()
    out = worker_error(error, "worker 1 (pid 7 on 10.0.0.2) during step 3")
    assert type(out) is KeyError and str(out) == "'labels'"
    assert out.__notes__ == ["zeroray: raised on worker 1 (pid 7 on 10.0.0.2) during step 3; the worker's "
                             "traceback is printed above"]
    assert isinstance(out.__cause__, WorkerTraceback) and "in loss_fn" in str(out.__cause__)
    assert str(out.__cause__).startswith("worker 1 (pid 7 on 10.0.0.2) during step 3:")
    # An exception that did not pickle arrives as Ray's RayError: a WorkerError with its last line.
    unpicklable = rex.RayTaskError("Worker.train_step", "Traceback ...\nLockError: cannot pickle",
                                   rex.RayError("Exception x.LockError isn't serializable"))
    out = worker_error(unpicklable, "worker 0 (pid 5 on 10.0.0.1) during step 0")
    assert type(out) is WorkerError and "isn't serializable" in str(out) and "worker 0" in str(out)


def test_scaling_policy_full_size_when_it_fits():
    policy = ScalingPolicy(target=4, minimum=2, cpus_per_worker=2, use_gpu=False)
    decision = policy.on_restart(free_cpus=8, free_gpus=0)
    assert decision.action is Action.RESTART and decision.num_workers == 4
    assert policy.on_restart(free_cpus=100, free_gpus=0).num_workers == 4  # never above the target


def test_scaling_policy_shrinks_down_to_min_workers():
    policy = ScalingPolicy(target=4, minimum=2, cpus_per_worker=2, use_gpu=False)
    decision = policy.on_restart(free_cpus=6.5, free_gpus=0)
    assert decision.action is Action.RESIZE and decision.num_workers == 3
    assert "room for 3" in decision.reason and "min_workers=2" in decision.reason
    # Fewer than min_workers fit now: ask for min_workers and let placement wait for them.
    short = policy.on_restart(free_cpus=1, free_gpus=0)
    assert short.num_workers == 2 and "fewer than min_workers=2" in short.reason


def test_scaling_policy_without_min_workers_waits_for_full_size():
    policy = ScalingPolicy(target=3, minimum=None, cpus_per_worker=1, use_gpu=False)
    decision = policy.on_restart(free_cpus=2, free_gpus=0)
    assert decision.num_workers == 3 and decision.action is Action.RESTART


def test_scaling_policy_counts_gpus():
    policy = ScalingPolicy(target=4, minimum=1, cpus_per_worker=1, use_gpu=True)
    assert policy.fits(free_cpus=16, free_gpus=2) == 2
    decision = policy.on_restart(free_cpus=16, free_gpus=2)
    assert decision.action is Action.RESIZE and decision.num_workers == 2
    assert policy.workers_for(free_cpus=16, free_gpus=0) == 1  # min_workers; placement then waits


def test_scaling_policy_goes_on_with_the_survivors_down_to_min_workers():
    policy = ScalingPolicy(target=3, minimum=2, cpus_per_worker=1, use_gpu=False)
    decision = policy.on_lost(survivors=2)
    assert decision.action is Action.RESIZE and decision.num_workers == 2 and "min_workers=2" in decision.reason
    assert policy.on_lost(survivors=1).action is Action.RESTART
    # Without min_workers the group waits for its full size, as before.
    assert ScalingPolicy(target=3, minimum=None, cpus_per_worker=1, use_gpu=False).on_lost(2).action is Action.RESTART
