"""Fault tolerance with real Ray actors: a worker killed in the middle of fit (stage 3) costs
no training, a hung collective or an impossible placement fails fast with a clear error.

Each recovery test kills a worker while fit runs, with checkpoints every 2 steps: fit notices,
tears the group down, starts a new one, restores the last checkpoint, replays the data, and
the final parameters equal those of uninterrupted training (plain PyTorch on the same batches,
which test_trainer_parity shows equals an uninterrupted zeroray run) within 1e-5.

Every fault lands at a point the test controls, never on a timer racing the steps: the
ray.kill test waits until the actor is dead before fit dispatches the next step (the step
already in flight may end before or after the kill; either way fit resumes from the same
checkpoint), and the SIGKILL test kills worker 1 while it is blocked inside loss_fn of the
step on a known batch, after the worker said so, so neither the machine's load nor fit's
pipelining ([Note: pipelined steps]) can change which step fails.
"""
import functools
import hashlib
import os
import signal
import threading
import time

import pytest
import ray
import torch

import zeroray as zr
from tests.models import VOCAB, lm_loss, make_batches, parity_model, reference_run
from tests.ray.test_shutdown import assert_released, group_ids, live_placement_groups
from tests.ray.user_dist import check_group, dist_view
from zeroray.runtime.failures import CollectiveTimeoutError, PlacementError

STEPS = 8
KILL_AT = 5        # SIGKILL test: worker 1 dies inside the step on batch 5 (five steps done, checkpoint at 4)
EVERY = 2
SLOW_MARK = VOCAB - 1  # a worker whose whole shard is this token sleeps in loss_fn (a hung rank)


def slow_rank_loss(model, batch):
    idx, _ = batch
    if bool((idx == SLOW_MARK).all()):
        time.sleep(60)  # far beyond collective_timeout_s; the driver kills this worker long before
    return lm_loss(model, batch)


@pytest.fixture(scope="module")
def reference():
    batches = make_batches(STEPS)
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                                           weight_decay=0.1)
    return batches, reference_run(parity_model, lm_loss, make_opt, batches)[2]


def fingerprint(idx):
    return hashlib.sha1(idx.contiguous().numpy().tobytes()).hexdigest()


def gated_loss(gate_dir, model, batch, inner=slow_rank_loss):
    """``inner`` (slow_rank_loss), except that the process named in ``gate_dir/gate`` blocks here
    (mid-step) on the batch named there (its fingerprint), after saying so in ``gate_dir/blocked``,
    until the test kills it. Naming the batch makes the step deterministic although fit sends the
    next step early."""
    gate = os.path.join(gate_dir, "gate")
    if os.path.exists(gate) and open(gate).read().split() == [str(os.getpid()), fingerprint(batch[0])]:
        with open(os.path.join(gate_dir, "blocked.tmp"), "w") as f:
            f.write(fingerprint(batch[0]))
        os.replace(os.path.join(gate_dir, "blocked.tmp"), os.path.join(gate_dir, "blocked"))
        time.sleep(300)  # the test SIGKILLs this process long before
    return inner(model, batch)


def wait_for(condition, what, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def pid_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie holds nothing and runs nothing
    except FileNotFoundError:
        return True


def actor_dead(actor, probe="node_info", timeout_s=30):
    """Whether a call of ``actor``'s method ``probe`` fails because the actor is gone."""
    try:
        ray.get(getattr(actor, probe).remote(), timeout=timeout_s)
        return False
    except ray.exceptions.RayActorError:
        return True


class KillingData:
    """Re-iterable global batches; the first pass calls ``kill()`` as batch ``at`` is fetched."""

    def __init__(self, batches, at, kill):
        self.batches, self.at, self.kill = batches, at, kill
        self.killed_at = None

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.at and self.killed_at is None:
                self.killed_at = time.monotonic()
                self.kill()
            yield batch


def _trainer(tmp_path, loss_fn=lm_loss, max_failures=1, **zero):
    return zr.Trainer(parity_model, loss_fn, optimizer=zr.AdamW(lr=1e-2, weight_decay=0.1),
                      zero=zr.ZeroConfig(stage=3, **zero), scaling=zr.ScalingConfig(num_workers=2),
                      failure=zr.FailureConfig(max_failures=max_failures),
                      checkpoint=zr.CheckpointConfig(path=str(tmp_path), every_steps=EVERY, keep=2))


def _check_recovered(trainer, data, results, ref_state, old_ids, old_pids, resumed_steps):
    assert trainer.step_count == STEPS and [r.step for r in results] == list(range(STEPS - len(results) + 1, STEPS + 1))
    assert len(trainer.recoveries) == 1, trainer.recoveries
    rec = trainer.recoveries[0]
    assert rec["step"] in resumed_steps, rec  # the last checkpoint before the death
    assert {w["pid"] for w in trainer.workers}.isdisjoint(old_pids)  # a fresh group
    check_group(trainer.run(dist_view), 2)  # torch.distributed's default group among the new workers
    assert_released(*old_ids)  # the old group's actors and placement group are gone
    sd = trainer.state_dict()
    err = max((sd[k] - v).abs().max().item() for k, v in ref_state.items())
    detect_s = rec["detected_at"] - data.killed_at
    print(f"\n  death -> detected {detect_s:.2f} s, detected -> resumed {rec['seconds']:.1f} s (teardown "
          f"{rec['teardown_s']:.1f}, new group {rec['start_s']:.1f} = placement {rec['placement_s']:.1f} + actor "
          f"processes {rec['actors_s']:.1f} + engine setup {rec['setup_s']:.1f}, restore {rec['restore_s']:.1f}); death -> "
          f"resumed {rec['resumed_at'] - data.killed_at:.1f} s; max |param - uninterrupted| = {err:.2e}\n"
          f"  cause: {rec['cause'][:160]}")
    assert detect_s < 10, "the failure must be noticed within seconds"
    assert trainer.last_recovery_s == rec["seconds"]
    assert err <= 1e-5
    return err


def _kill_actor(actor):
    """ray.kill, then wait until the actor is dead: the step fit dispatches next finds it gone."""
    ray.kill(actor)
    wait_for(lambda: actor_dead(actor), "the killed actor to be dead")


def test_ray_kill_mid_fit_recovers_then_max_failures_raises(ray_local, reference, tmp_path):
    batches, ref_state = reference
    with _trainer(tmp_path) as trainer:
        # A first fit saves at step 2. The second fit, on other data, loses a worker before its own
        # first checkpoint: it resumes from step 2 and replays its data from its start (position 0),
        # not from the position the step-2 checkpoint recorded in the first fit's data.
        trainer.fit(batches[:EVERY], progress=False)
        old_ids, old_pids = group_ids(trainer), {w["pid"] for w in trainer.workers}
        data = KillingData(batches[EVERY:], 1, lambda: _kill_actor(trainer.controller.group.actors[1]))
        results = trainer.fit(data, skip=0, progress=False)
        _check_recovered(trainer, data, results, ref_state, old_ids, old_pids, resumed_steps={EVERY})

        # With no failures left to spend, the next death ends fit with the original cause.
        trainer.failure = zr.FailureConfig(max_failures=0)
        more = KillingData(make_batches(3, seed=7), 1, lambda: _kill_actor(trainer.controller.group.actors[0]))
        with pytest.raises(RuntimeError, match=r"max_failures=0.*original cause: WorkerDiedError.*died") as info:
            trainer.fit(more, skip=0, progress=False)
        print(f"  after max_failures: {str(info.value)[:300]}")
        assert "ActorDiedError" in str(info.value)


def test_sigkill_mid_fit_recovers_then_hung_collective_raises(ray_local, reference, tmp_path):
    batches, ref_state = reference
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    loss_fn = functools.partial(gated_loss, str(gate_dir))
    with _trainer(tmp_path / "ckpt", loss_fn=loss_fn, collective_timeout_s=5.0) as trainer:
        old_ids, old_pids = group_ids(trainer), {w["pid"] for w in trainer.workers}
        pid = trainer.workers[1]["pid"]
        landed = {}
        target = fingerprint(batches[KILL_AT][0][batches[KILL_AT][0].shape[0] // 2:])  # worker 1's rows

        def kill_mid_step():
            # Armed as fit fetches batch KILL_AT, before its step is sent; worker 1 blocks in the
            # loss_fn of the step on that batch (its half of it), says so, and only then is it
            # killed: the kill lands inside that step on any machine.
            (gate_dir / "gate").write_text(f"{pid} {target}")

            def killer():
                wait_for((gate_dir / "blocked").exists, "worker 1 to block in loss_fn")
                landed["batch"] = (gate_dir / "blocked").read_text()
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: pid_gone(pid), "the killed worker's process to exit")
                (gate_dir / "gate").unlink()
            threading.Thread(target=killer, daemon=True).start()

        data = KillingData(batches, KILL_AT, kill_mid_step)
        results = trainer.fit(data, progress=False)
        # The kill landed inside step KILL_AT + 1 (KILL_AT steps were done), so fit resumed from
        # the checkpoint of step 4, the last one before it.
        assert landed == {"batch": target}, landed
        _check_recovered(trainer, data, results, ref_state, old_ids, old_pids, resumed_steps={4})

        # No hangs: worker 1 never reaches the step's first collective; worker 0 gives up after
        # collective_timeout_s and the driver names worker 1.
        idx, tgt = make_batches(1, seed=9)[0]
        idx = idx.clone()
        idx[idx.shape[0] // 2:] = SLOW_MARK
        ids = group_ids(trainer)
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"worker\(s\) \[1 \(pid \d+ .*did not arrive") as info:
            trainer.step((idx, tgt))
        took = time.monotonic() - t0
        print(f"  hung collective raised after {took:.1f} s: {str(info.value)[:400]}")
        assert info.value.ranks == [1] and took < 30
        assert_released(*ids)  # the stuck group was torn down: nothing keeps sleeping or waiting


def test_placement_timeout_says_what_is_missing(ray_local):
    before = live_placement_groups()
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as info:
        zr.Trainer(parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2, cpus_per_worker=100,
                                                                   placement_timeout_s=2))
    message = str(info.value)
    print(f"\n  {message}")
    assert time.monotonic() - t0 < 20
    assert "placement_timeout_s=2" in message and "CPU 200 in all" in message and "the cluster has CPU" in message
    assert_released((), live_placement_groups() - before)
