"""The main job: a small GPT trained character-level on Python's own documentation, with zeroray.

    python examples/train_gpt.py                      # 2 workers, ZeRO stage 3, CPU, local Ray
    python examples/train_gpt.py --stage 2 --dtype bf16 --num-workers 3
    RAY_ADDRESS=... python examples/train_gpt.py     # the same on a cluster (see cluster/README.md)

Elastic runs: save every N steps, stop, and go on later at another size, stage or dtype.

    python examples/train_gpt.py --checkpoint-dir ckpts --checkpoint-every 25 --num-workers 2
    python examples/train_gpt.py --checkpoint-dir ckpts --checkpoint-every 25 --resume latest --num-workers 3

See [Note: resuming the main job] below.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gpt  # beside this script: zr.Trainer sends its code to the workers, wherever they run

import zeroray as zr
from zeroray.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, list_checkpoints, load_manifest
from zeroray.checkpoint.filesystem import resolve
from zeroray.runtime.failures import PlacementError

# [Note: resuming the main job]
# `--resume` continues a run from one of its sharded checkpoints: `latest` is the newest complete
# one under --checkpoint-dir (the one its `latest` pointer names, which a save moves only once
# every shard is written), PATH a checkpoint root or a step_<N> directory. zeroray restores a
# checkpoint at any number of workers and any stage or dtype (the fp32 master weights and the
# optimizer state are resharded to the new layout), so --num-workers, --stage and --dtype may
# differ from the run that saved.
# --steps is the run's total: a resumed job trains from the checkpoint's step up to it. The data
# continues where it stopped: CharBatches regenerates the same global batches from --seed, the
# checkpoint records how many were consumed (data_position), and fit skips those, so every step
# sees the batch an uninterrupted run would have given it. At another --num-workers the same
# global batch is split otherwise (16 rows over 3 workers: 6, 5, 5, each worker's loss weighted
# by its rows), which is the same step: the losses go on as in one run, to float rounding. That
# needs the same --seed (checked against the checkpoint's config), --batch-size and --seq-len
# (recorded by this script in RUN_RECORD beside the checkpoints, and checked), and the same
# model shape (zeroray's restore checks it). --grad-accum may change: it splits each worker's
# rows, not the global batch.
# --stop-after K ends a run after step K, saved, as a preemption or a time limit would: the run
# is unfinished, and --resume takes it on to --steps.
# The optimizer goes on as it was saved: a --resume without --lr or --adam-eps restores the
# checkpoint's AdamW, its hyperparameters and state (zr.Trainer.restore without optimizer=); either
# flag restates it (AdamW with the flags given and the defaults for the others), and zeroray logs
# which hyperparameters that changes. So a resume that leaves out the --lr the run was started
# with keeps that lr, instead of the script's default. (A checkpoint from before zeroray recorded
# the optimizer gets the script's AdamW from the flags, as it did then.)
# Nothing is lost by a mistake on the command line: a --resume with no checkpoint to read, or
# with another --batch-size, --seq-len or --seed than the run saved with, or a fresh run into a
# --checkpoint-dir that already holds one (whose saves would prune it), is refused before
# anything starts or is written. Errors are printed as a message and exit code 1, without a
# traceback; --debug shows the traceback.

RUN_RECORD = "train_gpt.json"  # in the checkpoint root: what the data order depends on
DATA_ARGS = ("batch_size", "seq_len")


LR, ADAM_EPS = 3e-3, 1e-8  # a fresh run's optimizer: AdamW(lr=LR, eps=ADAM_EPS, weight_decay=0.0)


def optimizer(args, resuming: bool):
    """The optimizer the flags ask for; None on a --resume that gives neither --lr nor --adam-eps:
    the checkpoint's, as it was saved ([Note: resuming the main job])."""
    if resuming and args.lr is None and args.adam_eps is None:
        return None
    return zr.AdamW(lr=LR if args.lr is None else args.lr, eps=ADAM_EPS if args.adam_eps is None else args.adam_eps,
                    weight_decay=0.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split over the workers")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=None,
                   help=f"AdamW's lr (default {LR}; with --resume, the checkpoint's unless given)")
    p.add_argument("--adam-eps", type=float, default=None,
                   help=f"AdamW's eps (default {ADAM_EPS}; with --resume, the checkpoint's unless given)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--checkpoint-dir", default=None,
                   help="save a sharded checkpoint here at the end (and every --checkpoint-every steps)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="save every N steps under --checkpoint-dir")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="keep the newest K checkpoints under --checkpoint-dir")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                   help="continue from a checkpoint: 'latest' (the default) is the newest under --checkpoint-dir, "
                        "PATH a checkpoint root or step_<N> directory; any --num-workers, --stage, --dtype")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="stop after step K, saved, as if interrupted there; --resume goes on to --steps")
    p.add_argument("--metrics", default=None, help="append per-step metrics to this JSONL file")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its message")
    args = p.parse_args(argv)
    for name in ("steps", "checkpoint_every", "keep_checkpoints", "stop_after"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} {value}: it must be >= {0 if name == 'steps' else 1}")
    if args.checkpoint_dir is None:
        for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--stop-after", args.stop_after),
                            ("--resume latest", args.resume == "latest" or None)):
            if value is not None:
                p.error(f"{flag} needs --checkpoint-dir DIR: where the checkpoints are saved"
                        + (" (else the stopped run's work is lost)" if flag == "--stop-after" else "")
                        + (" and looked for" if flag == "--resume latest" else ""))
    return args


def resume_point(args) -> "str | None":
    """The step directory to continue from, or None for a fresh run; exits with a message (before
    anything starts or is written) when there is none, or when a fresh run would prune one."""
    if args.resume is None:
        found = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
        if found is not None:
            sys.exit(f"{args.checkpoint_dir} already holds a checkpoint ({found}) that this fresh run's saves "
                     "would prune: continue that run with --resume latest, or pass another --checkpoint-dir")
        return None
    if args.resume == "latest":
        found = latest_checkpoint(args.checkpoint_dir)
        if found is None:
            sys.exit(f"no checkpoint under {args.checkpoint_dir}: run without --resume first, "
                     "or pass --checkpoint-dir")
    else:
        try:
            found = checkpoint_dir(args.resume)
        except CheckpointError as error:
            sys.exit(f"no checkpoint at {args.resume}: run without --resume first, or pass a checkpoint root "
                     f"or step_<N> directory ({error})")
    saved_seed = load_manifest(found).config.get("seed")
    if saved_seed is not None and saved_seed != args.seed:
        sys.exit(f"{found} was saved by a run with --seed {saved_seed}, this one has --seed {args.seed}: "
                 f"resume with --seed {saved_seed}, or the data would not continue where it stopped")
    check_run_record(found, args)
    return str(found)


def _record_path(root):
    storage, path = resolve(root)
    return storage, storage.join(path, RUN_RECORD)


def write_run_record(args) -> None:
    """A fresh run with --checkpoint-dir: record the arguments the data order depends on."""
    storage, path = _record_path(args.checkpoint_dir)
    storage.makedirs(storage.split(path)[0])
    storage.write_bytes(path, json.dumps({name: getattr(args, name) for name in DATA_ARGS}).encode())


def check_run_record(step_dir, args) -> None:
    """Exit with a message when --batch-size or --seq-len differ from the run that saved ``step_dir``:
    the resumed run would train on other global batches than an uninterrupted one."""
    storage, path = resolve(step_dir)
    root = storage.split(path)[0]
    record = storage.join(root, RUN_RECORD)
    if storage.entry(record) is None:
        print(f"note: {storage.display(root)} holds no {RUN_RECORD} (a run of an older train_gpt.py?): "
              "--batch-size and --seq-len are not checked against the saved run; keep them as they were",
              file=sys.stderr)
        return
    saved = json.loads(storage.read_bytes(record))
    changed = [(name, saved[name], getattr(args, name)) for name in DATA_ARGS
               if name in saved and saved[name] != getattr(args, name)]
    if changed:
        flags = ", ".join(f"--{n.replace('_', '-')} {new} (saved with {old})" for n, old, new in changed)
        again = " ".join(f"--{n.replace('_', '-')} {old}" for n, old, _ in changed)
        sys.exit(f"{step_dir} was saved by a run with other data: {flags}. A resumed run continues the saved "
                 f"run's global batches, so they must stay as they were: resume with {again} (--num-workers, "
                 "--stage, --dtype and --grad-accum may change), or start a fresh run in another --checkpoint-dir")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except (ValueError, OSError, PlacementError) as error:  # a user's or the machine's: CheckpointError too
        if args.debug or os.environ.get("ZERORAY_DEBUG"):
            raise
        print(f"{os.path.basename(sys.argv[0] or 'train_gpt.py')}: error: {error}", file=sys.stderr)
        print("(--debug or ZERORAY_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


def train(args) -> int:
    resume_from = resume_point(args)
    if resume_from is None and args.checkpoint_dir:
        write_run_record(args)
    cfg = gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    t0 = time.perf_counter()
    options = dict(
        zero=zr.ZeroConfig(stage=args.stage, dtype=args.dtype, grad_accum_steps=args.grad_accum,
                           max_grad_norm=args.max_grad_norm,
                           activation_checkpointing=(gpt.Block,) if args.activation_checkpointing else False),
        scaling=zr.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                 placement_strategy=args.placement_strategy),
        checkpoint=zr.CheckpointConfig(path=args.checkpoint_dir, every_steps=args.checkpoint_every,
                                       keep=args.keep_checkpoints),
        seed=args.seed, metrics_path=args.metrics)
    # a checkpoint from before zeroray recorded its optimizer gets this script's, as it was then
    chosen = optimizer(args, resuming=resume_from is not None and load_manifest(resume_from).optimizer is not None)
    if resume_from is None:
        trainer = zr.Trainer(lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=chosen, **options)
    else:
        trainer = zr.Trainer.restore(resume_from, lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=chosen, **options)
    for w in trainer.workers:
        print(f"worker {w['rank']} on node {w['node_id']} ({w['ip']})", flush=True)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, ZeRO stage {args.stage}, {args.dtype}, "
          f"{args.num_workers} workers, global batch {args.batch_size} x {args.seq_len}", flush=True)
    if resume_from is not None:
        saved = load_manifest(resume_from)
        print(f"resumed from {resume_from}: step {trainer.step_count} of {args.steps}, saved by "
              f"{saved.world_size} worker(s), continuing with {trainer.num_workers}", flush=True)
        restated = args.lr is not None or args.adam_eps is not None
        print(f"optimizer: {trainer.controller.spec.optimizer!r}"
              + (" (the checkpoint's)" if chosen is None else " (restated by --lr/--adam-eps)" if restated
                 else " (this script's: the checkpoint does not record one)"), flush=True)
    # The whole run's batches: fit skips the data_position a restored checkpoint had consumed.
    data = gpt.CharBatches(args.batch_size, args.seq_len, args.steps, seed=args.seed)
    until = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    t_fit = time.perf_counter()
    results = trainer.fit(data, num_steps=max(0, until - trainer.step_count))
    fit_s = time.perf_counter() - t_fit
    if results:
        first, last = results[0].loss, sum(r.loss for r in results[-10:]) / min(10, len(results))
        print(f"steps {results[0].step}-{results[-1].step}: first loss {first:.4f}, "
              f"last loss (mean of last 10 steps) {last:.4f}")
        print(f"wall time {time.perf_counter() - t0:.1f}s (training {fit_s:.1f}s, "
              f"{fit_s / len(results):.3f}s/step)")
    else:
        print(f"nothing to train: the run is at step {trainer.step_count} and --steps is {args.steps}")
    for rep in trainer.memory_report():
        m, e = rep["measured"], rep["estimate"]
        print(f"worker {rep['rank']}: model state {m['total'] / 2**20:.2f} MiB (params {m['params'] / 2**20:.2f}, "
              f"grads {m['grads'] / 2**20:.2f}, optimizer {m['optimizer'] / 2**20:.2f}); "
              f"estimate {e['total'] / 2**20:.2f} MiB; peak RSS {rep['peak_rss_bytes'] / 2**20:.0f} MiB")
    if args.checkpoint_dir:
        # fit has saved this step already when it fell on --checkpoint-every.
        saved_at = dict(list_checkpoints(args.checkpoint_dir))
        print(f"checkpoint: {saved_at.get(trainer.step_count) or trainer.save(args.checkpoint_dir)}")
    if trainer.step_count < args.steps:
        print(f"stopped at step {trainer.step_count} of {args.steps}: continue with --resume latest")
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
