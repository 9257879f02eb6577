"""Ray Tune sweeps of zeroray Trainers on the local multi-node cluster, with real Tune: the README's
"Hyperparameter sweeps with Ray Tune" commands, as written there.

- ASHA: 4 trials over the learning rate, 2 workers each; some are stopped early.
- PBT: 2 trials (2 workers and 1); at the perturbation step the worse trial continues from the
  better one's checkpoint with a mutated learning rate, at its own worker count. Its losses (and
  final evaluation) from there equal a run restored from that checkpoint by hand, in this
  process, with the same mutated lr, worker count and data, to the parity tolerance of
  tests/ray/test_trainer_parity.py (losses rel 1e-5); and a restore with the checkpoint's own lr
  gives other losses, so the mutated lr is what made them.
- Both: every worker actor ran in its trial's placement group, and nothing of the run (actor,
  placement group) is left once ``Tuner.fit`` returned (tests/e2e/tune_driver.py checks these
  on the cluster, from the run's own driver).

Each command runs as the example's driver (tests/e2e/tune_driver.py runs examples/tune_lr.py's
``main`` with the command's arguments, then checks the cluster), with RAY_ADDRESS pointing at the
cluster test_chaos.py ran on (tests/e2e/conftest.py), in a temp directory that holds the
``runs/tune`` storage; the nodes share this machine's file system, so the test reads the trials'
results and checkpoints there.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zeroray as zr
from examples import gpt
from tests.local_cluster import LocalCluster
from tests.readme_commands import ways_to_run

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("tune_driver.py")
MARKER = "TUNE_REPORT "

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local-cluster.sh needs Linux"),
    pytest.mark.skipif(shutil.which("setsid") is None, reason="local-cluster.sh needs setsid"),
]


def readme_commands() -> dict:
    """The README's Tune commands, by scheduler, as written there (tests/readme_commands.py)."""
    lines = [c.split("#", 1)[0].strip() for c in ways_to_run()["Hyperparameter sweeps with Ray Tune"]]
    commands = [shlex.split(line) for line in lines if line.startswith("python examples/tune_lr.py")]
    return {("pbt" if "pbt" in c else "asha"): c[2:] for c in commands}


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster


def _sweep(cluster: LocalCluster, args: list, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(cluster.client_env(), RAY_ADDRESS=cluster.gcs_address, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(DRIVER), *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARKER)]
    table = re.search(r"^(asha|pbt): \d+ trials.*?^best: .*?$", out.stdout, re.S | re.M)
    print(table.group(0) if table else out.stdout[-3000:])
    assert out.returncode == 0 and lines, f"rc {out.returncode}:\n{out.stdout[-5000:]}\n{out.stderr[-5000:]}"
    report = json.loads(lines[-1][len(MARKER):])
    checks = report["checks"]
    assert checks["worker_actors"] > 0 and checks["trial_groups"] > 0, checks
    assert not checks["workers_outside_trial_groups"], checks
    assert not checks["trial_groups_with_wrong_worker_count"], checks
    assert not checks["reported_groups_not_trial_groups"], checks
    assert not checks["reported_groups_with_wrong_worker_count"], checks
    assert not any(checks["leftovers"].values()), checks["leftovers"]
    return report


def test_readme_commands_are_the_two_sweeps():
    assert set(readme_commands()) == {"asha", "pbt"}


def test_asha_sweep_stops_trials_early(cluster, tmp_path):
    report = _sweep(cluster, readme_commands()["asha"], tmp_path)
    trials = report["trials"]
    assert len(trials) == 4 and not any(t["error"] for t in trials)
    stopped = [t for t in trials if t["stopped_early"]]
    assert 1 <= len(stopped) < 4, trials
    assert all(t["steps"] < report["steps"] for t in stopped)
    best = min(trials, key=lambda t: t["loss"])
    assert best["lr"] == max(t["lr"] for t in trials) and not best["stopped_early"]  # the largest lr learns fastest
    assert all(t["num_workers"] == 2 and len(t["placement_groups"]) == 1 for t in trials)


def _rows(trial_path: str) -> list:
    return [json.loads(line) for line in Path(trial_path, "result.json").read_text().splitlines()]


def _by_hand(setup: dict, checkpoint: str, lr: float, num_workers: int):
    """Restore ``checkpoint`` with ``lr`` at ``num_workers`` and train on the run's data to its end,
    as the trial does: (losses by step, the final evaluation loss)."""
    cfg = gpt.GPTConfig(**setup["model"])
    data = gpt.CharBatches(setup["batch_size"], cfg.seq_len, setup["steps"], seed=setup["seed"])
    evals = list(gpt.CharBatches(setup["batch_size"], cfg.seq_len, setup["eval_batches"], seed=setup["eval_seed"]))
    with zr.Trainer.restore(checkpoint, lambda: gpt.GPT(cfg), gpt.gpt_loss, seed=setup["seed"],
                            optimizer=zr.AdamW(lr=lr, weight_decay=setup["weight_decay"]),
                            zero=zr.ZeroConfig(stage=setup["stage"]),
                            scaling=zr.ScalingConfig(num_workers=num_workers)) as trainer:
        results = trainer.fit(data, num_steps=setup["steps"] - trainer.step_count, progress=False, eval_data=evals)
        return {r.step: r.loss for r in results}, results[-1].evaluation["loss"]


def test_pbt_exploited_trial_equals_a_restore_by_hand(cluster, tmp_path, ray_local):
    report = _sweep(cluster, readme_commands()["pbt"], tmp_path)
    trials = {t["trial"]: t for t in report["trials"]}
    exploited = [t for t in trials.values() if t["exploited_from"]]
    assert len(exploited) == 1, list(trials.values())
    clone, source = exploited[0], trials[exploited[0]["exploited_from"][0]]
    assert clone["num_workers"] != source["num_workers"]  # restored at another worker count
    rows = _rows(clone["path"])
    checkpoint = next(p for p in clone["restored_from"] if p.startswith(source["path"] + os.sep))
    after = [r for r in rows if r["restored_from"] == checkpoint]
    lr = after[0]["config"]["lr"]
    # mutated from the cloned trial's lr (PBT: times 0.8 or 1.2), then kept. Not judged against the
    # trial's first rows: Tune may lose a restarted trial's earlier rows (tests/e2e/tune_driver.py)
    assert any(lr == pytest.approx(source["lr"] * f, rel=1e-9) for f in (0.8, 1.2)), (lr, source["lr"])
    assert all(r["config"]["lr"] == lr for r in after)
    saved_step = json.loads(Path(checkpoint, "manifest.json").read_text())["step"]
    tuned = {r["step"]: r["loss"] for r in after}
    assert min(tuned) == saved_step + 1 and max(tuned) == report["steps"], sorted(tuned)

    losses, eval_loss = _by_hand(report["setup"], checkpoint, lr, clone["num_workers"])
    print(f"PBT: {clone['trial']} ({clone['num_workers']} worker(s)) continued from {checkpoint} (step {saved_step}, "
          f"saved by {source['num_workers']}) with lr {lr:.4g}:")
    for step in sorted(tuned):
        print(f"  step {step}: trial loss {tuned[step]:.7f}, by hand {losses[step]:.7f}")
    print(f"  final eval loss: trial {after[-1]['eval_loss']:.7f}, by hand {eval_loss:.7f}")
    assert sorted(losses) == sorted(tuned)
    for step, want in losses.items():
        assert tuned[step] == pytest.approx(want, rel=1e-5), step
    assert after[-1]["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)

    unmutated, _ = _by_hand(report["setup"], checkpoint, source["lr"] if source["lr"] != lr else lr * 2,
                            clone["num_workers"])
    assert max(abs(unmutated[s] - tuned[s]) for s in tuned) > 1e-4  # the lr given to restore is what trained
