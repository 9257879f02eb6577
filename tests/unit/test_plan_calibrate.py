"""A CPU machine's measurements turned into a plan.Cluster (zeroray/plan/calibrate.py, [Note: CPU
calibration]): gloo's α–β recovered from timings, the contended floor's ratios with the ideal share of
the cores divided out, the engine's single-process ratio, and the cluster whose replayed one-worker
step is the measured one. Pure arithmetic on synthetic measurements."""
import pytest

from zeroray import plan
from zeroray.plan.calibrate import contended_figures, cpu_cluster, engine_ratio, gloo_ring, quantile, undisturbed


def _gloo(world: int, lat: float, bw: float) -> list:
    """collectives.py's rows for a ring of ``lat`` s per hop and ``bw`` bytes/s (times in ms)."""
    rows = []
    for mb in (0.5, 2.0, 8.0):
        t = (world - 1) * lat + (world - 1) / world * mb * 1e6 / bw
        rows.append({"mb": mb, "world": world, "all_gather exchange": t * 1e3, "reduce_scatter exchange": t * 1e3})
    return rows


def test_gloo_ring_recovers_alpha_beta():
    lat, bw = gloo_ring(_gloo(3, 2e-4, 1.5e9) + _gloo(2, 9e-4, 3e9), 3)
    assert lat == pytest.approx(2e-4) and bw == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="world 4"):
        gloo_ring(_gloo(3, 2e-4, 1.5e9), 4)


def test_contended_floor_less_the_share_of_the_cores():
    # three copies on two cores, each 1.5x alone: exactly the share, nothing beyond it
    contention, straggler = contended_figures(0.45, 0.30, 0.54, copies=3, cores=2)
    assert contention == pytest.approx(1.0) and straggler == pytest.approx(1.2)
    # one copy per core: no share to divide out; a slowest copy faster than the median reads 1
    contention, straggler = contended_figures(0.33, 0.30, 0.32, copies=2, cores=2)
    assert contention == pytest.approx(1.1) and straggler == 1.0
    # together faster than alone, or under the ideal share: read as measured (no rule lifts it to 1)
    assert contended_figures(0.29, 0.30, 0.30, copies=2, cores=2)[0] == pytest.approx(0.29 / 0.30)
    assert contended_figures(0.43, 0.30, 0.45, copies=3, cores=2)[0] == pytest.approx(0.43 / 0.30 / 1.5)
    with pytest.raises(ValueError, match="positive"):
        contended_figures(0.3, 0.0, 0.3, copies=2, cores=2)


def test_copies_that_waited_beyond_their_own_sharing_were_disturbed():
    # three copies on two cores: at worst two share a core, so a wall time up to twice the CPU seconds
    assert undisturbed(0.55, 0.30, copies=3, cores=2) and undisturbed(0.60, 0.30, copies=3, cores=2)
    assert not undisturbed(0.80, 0.30, copies=3, cores=2)
    # one copy per core: none waits for a core
    assert undisturbed(0.30, 0.30, copies=2, cores=2) and not undisturbed(0.36, 0.30, copies=2, cores=2)


def test_engine_ratio_pairs_each_engine_step_with_the_plain_one():
    # the background load moves both halves of a pair alike: the ratio stays
    ratio = engine_ratio([0.112, 0.224, 0.113], [0.100, 0.200, 0.100], [0.002, 0.004, 0.003])
    assert ratio == pytest.approx(1.1)
    assert engine_ratio([0.11, 0.30], [0.1, 0.1], [0.0, 0.0], q=0.0) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="one of each per step"):
        engine_ratio([0.1], [0.1, 0.1], [0.0])
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_cpu_cluster_replays_the_measured_single_process_step():
    w = plan.model_preset("gpt2", seq_len=128)
    gloo = _gloo(2, 3e-4, 1.2e9) + _gloo(3, 3e-4, 1.0e9)
    one = plan.RunConfig(0, 1, micro_batch=8, dtype="fp32", checkpointing=False, optimizer="adamw")
    kw = dict(adamw_s=0.05, params=w.params, micro_batch=8)
    engine = cpu_cluster(w, gloo, 2, 2.0, step_s=3.0, **kw)
    r = plan.simulate(w, engine, one)
    # the engine's step holds the gradient copies the replay adds: compute and copies are the step
    assert r.step_s - r.optimizer_s == pytest.approx(3.0)
    assert r.optimizer_s == pytest.approx(0.05)
    plain = plan.simulate(w, cpu_cluster(w, gloo, 2, 2.0, step_s=3.0, engine=False, **kw), one)
    assert plain.compute_s == pytest.approx(3.0) and plain.step_s > r.step_s
    # three workers on two cores: each computes at the shared pace, times the slowest rank's
    three = cpu_cluster(w, gloo, 3, 2.0, step_s=3.0, straggler=1.1, **kw)
    assert three.intra_bw == pytest.approx(1.0e9)
    cfg3 = plan.RunConfig(0, 3, micro_batch=8, dtype="fp32", checkpointing=False, optimizer="adamw")
    assert plan.simulate(w, three, cfg3).compute_s == pytest.approx(1.5 * 1.1 * r.compute_s)
    with pytest.raises(ValueError, match="gradient copies"):
        cpu_cluster(w, gloo, 2, 2.0, step_s=1e-6, **kw)
