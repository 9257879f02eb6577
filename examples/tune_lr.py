"""Sweep the learning rate of the main job's GPT (gpt.py) with Ray Tune: each trial is one zr.Trainer
whose workers run inside the trial's resources.

    python examples/tune_lr.py                   # ASHA: 4 trials over lr, 2 workers each; the poor ones stop early
    python examples/tune_lr.py --scheduler pbt   # PBT: 2 trials (2 workers and 1); the worse continues from the
                                                 # better one's checkpoint with a mutated lr, at its own worker count
    RAY_ADDRESS=... python examples/tune_lr.py  # the same on a cluster (give --storage a directory every node shares)

Every trial reports each step's loss to Tune (and the evaluation loss every --eval-every steps);
its checkpoints are zeroray sharded checkpoints, which Tune keeps under --storage. ASHA compares
the trials at steps 4, 8, ... (--grace) and stops the worse half at each; PBT pauses every trial
at step --perturb, and the worse trial restores the better one's checkpoint with the better
one's lr times 0.8 or 1.2. The table at the end says what happened to each trial.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gpt  # beside this script: zeroray sends its code to the trials and their workers
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

import zeroray as zr
import zeroray.tune as zt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", default="asha", choices=["asha", "pbt"])
    p.add_argument("--lrs", default=None, help="comma-separated learning rates, one trial each "
                                                "(asha: 3e-3,1e-3,3e-4,1e-4; pbt: 3e-3,1e-4)")
    p.add_argument("--num-workers", default=None, help="workers per trial, one value or one per trial "
                                                       "(asha: 2; pbt: 2,1)")
    p.add_argument("--steps", type=int, default=None, help="steps per trial (asha: 12, pbt: 8)")
    p.add_argument("--grace", type=int, default=4, help="asha: the first step at which trials are compared")
    p.add_argument("--perturb", type=int, default=5, help="pbt: the step at which trials are compared and exploited")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--storage", default="runs/tune", help="where Tune keeps the trials' results and checkpoints")
    p.add_argument("--name", default=None, help="the experiment's directory under --storage (default: tune_lr_<scheduler>)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    pbt = args.scheduler == "pbt"
    args.lrs = [float(x) for x in (args.lrs or ("3e-3,1e-4" if pbt else "3e-3,1e-3,3e-4,1e-4")).split(",")]
    workers = [int(x) for x in (args.num_workers or ("2,1" if pbt else "2")).split(",")]
    if len(workers) not in (1, len(args.lrs)):
        p.error(f"--num-workers: give one value or one per trial ({len(args.lrs)})")
    args.num_workers = workers * len(args.lrs) if len(workers) == 1 else workers
    args.steps = args.steps or (8 if pbt else 12)
    args.name = args.name or f"tune_lr_{args.scheduler}"
    return args


def setup(args) -> dict:
    """What every trial builds: the run's model, data and optimizer settings (also what a by-hand
    restore of one of its checkpoints needs)."""
    return {"model": dict(seq_len=args.seq_len, d_model=args.d_model, n_layers=2, n_heads=2),
            "batch_size": args.batch_size, "steps": args.steps, "seed": args.seed, "stage": args.stage,
            "eval_batches": 2, "eval_seed": args.seed + 1, "weight_decay": 0.0}


def make_train(s: dict):
    cfg = gpt.GPTConfig(**s["model"])

    def train(config, trial):
        # In PBT's exploit, Tune hands this trial another trial's checkpoint and a mutated config:
        # trial.trainer restores it with this optimizer, whose lr replaces the checkpoint's.
        trainer = trial.trainer(lambda: gpt.GPT(cfg), gpt.gpt_loss, seed=s["seed"],
                                optimizer=zr.AdamW(lr=config["lr"], weight_decay=s["weight_decay"]),
                                zero=zr.ZeroConfig(stage=s["stage"]))
        data = gpt.CharBatches(s["batch_size"], cfg.seq_len, s["steps"], seed=s["seed"])
        evals = list(gpt.CharBatches(s["batch_size"], cfg.seq_len, s["eval_batches"], seed=s["eval_seed"]))
        trial.fit(trainer, data, total_steps=s["steps"], eval_data=evals, eval_every=config["eval_every"],
                  checkpoint_every=config["checkpoint_every"])

    return train


def make_tuner(args, s: dict) -> tune.Tuner:
    pbt = args.scheduler == "pbt"
    workers = dict(zip(args.lrs, args.num_workers))  # one trial per learning rate
    if pbt:
        # synch: every trial pauses at --perturb, then the worse half continues from the better half's
        # checkpoints (a deterministic exploit); the lr is the cloned trial's times 0.8 or 1.2.
        scheduler = PopulationBasedTraining(time_attr="step", perturbation_interval=args.perturb,
                                            hyperparam_mutations={"lr": tune.loguniform(1e-5, 1e-1)},
                                            quantile_fraction=0.5, resample_probability=0.0, synch=True)
    else:
        scheduler = ASHAScheduler(time_attr="step", max_t=args.steps, grace_period=args.grace, reduction_factor=2)
    # A trial's resources follow its config; PBT's exploit copies the cloned trial's config (its
    # num_workers too), but a trial keeps the resources it started with: the exploited trial
    # restores the other's checkpoint at its own worker count (its reported num_workers).
    trainable = zt.trainable(make_train(s), lambda config: zr.ScalingConfig(num_workers=config["num_workers"]))
    return tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(args.lrs), "num_workers": tune.sample_from(lambda spec: workers[spec.config.lr]),
                     "eval_every": args.eval_every, "checkpoint_every": args.perturb if pbt else args.grace},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler),
        run_config=tune.RunConfig(name=args.name, storage_path=os.path.abspath(args.storage), verbose=1))


def summarize(results, args) -> list:
    """One record per trial: its config, how far it got, its last losses, what happened to it."""
    dirs = {r.path: os.path.basename(r.path) for r in results}
    out = []
    for r in results:
        df = r.metrics_dataframe
        restored = [p for p in df["restored_from"].dropna().unique()] if "restored_from" in df else []
        cloned = sorted({name for p in restored for d, name in dirs.items()
                         if p.startswith(d + os.sep) and d != r.path})
        steps = int(r.metrics.get("step", 0))
        out.append({"trial": os.path.basename(r.path), "path": r.path, "lr": r.config["lr"],
                    "num_workers": int(r.metrics.get("num_workers", 0)), "steps": steps,
                    "loss": r.metrics.get("loss"), "eval_loss": r.metrics.get("eval_loss"),
                    "stopped_early": r.error is None and steps < args.steps, "error": str(r.error) if r.error else None,
                    "restored_from": restored, "exploited_from": cloned,
                    "placement_groups": sorted(df["placement_group"].dropna().unique()) if "placement_group" in df else []})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not ray.is_initialized():
        # Locally, oversubscribe a small machine: a trial reserves 1 + num_workers CPUs.
        ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(8, os.cpu_count() or 1)}))
    s = setup(args)
    t0 = time.perf_counter()
    results = make_tuner(args, s).fit()
    trials = summarize(results, args)
    print(f"\n{args.scheduler}: {len(trials)} trials, {args.steps} steps each, in {time.perf_counter() - t0:.0f}s")
    print(f"{'trial':<44} {'lr':>9} {'workers':>7} {'steps':>5} {'loss':>7} {'eval':>7}  what happened")
    for t in trials:
        what = ("stopped early by ASHA" if t["stopped_early"] else f"error: {t['error']}" if t["error"] else "ran to the end")
        if t["exploited_from"]:
            what += f"; exploited: continued from {', '.join(t['exploited_from'])}'s checkpoint"
        loss, evl = (f"{v:7.4f}" if v is not None else "-" for v in (t["loss"], t["eval_loss"]))
        print(f"{t['trial'][:44]:<44} {t['lr']:>9.2e} {t['num_workers']:>7} {t['steps']:>5} {loss:>7} {evl:>7}  {what}")
    best = results.get_best_result()
    print(f"best: lr {best.config['lr']:.2e}, loss {best.metrics['loss']:.4f}, checkpoint {best.checkpoint.path}")
    return {"scheduler": args.scheduler, "steps": args.steps, "setup": s, "trials": trials,
            "experiment": os.path.join(os.path.abspath(args.storage), args.name)}


if __name__ == "__main__":
    summary = main()
    print("summary: " + json.dumps(summary))
