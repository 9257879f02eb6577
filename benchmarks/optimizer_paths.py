"""The two optimizer paths ([Note: optimizer paths] in zeroray/engine/optim_choice.py): what the
whole-parameter path costs against the flat one on Adam, and what each gives an optimizer that
is not element-wise.

    python benchmarks/optimizer_paths.py --cost --rounds 3   # step time and memory, whole/flat
    python benchmarks/optimizer_paths.py --table             # issue 41's table, before and after

``--cost``: the bench model (benchmarks/common.py's BenchSpec: GPT, d_model 256, 4 layers, 2
workers, fp32, 8 rows of 128 characters per worker), stages 1-3, in 2 spawned gloo processes
without Ray, torch.optim.Adam on the flat path against the same Adam on the whole-parameter path
(a subclass that changes nothing, which zeroray cannot know to be element-wise: the same
arithmetic, moved and stepped whole). Rows interleaved, each ``--rounds`` times; per row the
medians over the timed steps (rank 0's, seconds) of the step and of the optimizer's part (the
exchange and the update), the bytes each rank sends per step, and, measured after the steps
(zeroray.memory.report.measure), the optimizer state each rank holds, and the bytes of the
exchange's buffers during a step (let go after it).
Ratios whole/flat per stage, from the same run.

``--table``: torch.optim.Adafactor and the Muon recipe (torch.optim.Muon on the 2-D hidden
weights, AdamW on the rest: tests/whole_param_optimizers.py) on transformers' GPT-2 from a tiny
config (tests/real_models.py), stages 0-3, 2 workers, fp32, 5 steps, against single-process torch
with the same optimizer and global batches: the largest relative loss difference over the steps
and the largest absolute parameter difference at the end, *before* (the flat path forced:
``zr.elementwise(...)``, what every release before issue 41 did) and *after* (the default). And a
model converted by ``convert_sync_batchnorm`` (tests/batchnorm_models.py) against single-process
plain BatchNorm on the global batch, with its running statistics: *before* the same model with
plain BatchNorm, a per-worker normalisation, which is what a SyncBatchNorm ran as on the workers
before torch.distributed existed there; *after* the SyncBatchNorm model. The
last column is single-process torch against itself with only its gradient's summation order
changed (two micro-batches accumulated): Muon's Newton-Schulz iteration runs in bf16, which turns
last-bit differences into parameter differences of the order of 1e-3, in torch alone too
(tests/dist/test_whole_param_optim.py bounds zeroray's Muon by that spread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import BenchSpec, global_batches, model_fn, worker_slice  # noqa: E402

STAGES = (1, 2, 3)


class WholeAdam(torch.optim.Adam):
    """torch's Adam, unchanged; being a subclass, it takes the whole-parameter path."""


def flat_adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def whole_adam(params):
    return WholeAdam(params, lr=1e-3)


PATHS = {"flat": flat_adam, "whole": whole_adam}


def _cost_row(rank: int, world: int, port: int, spec: BenchSpec, stage: int, path: str) -> dict:
    import zeroray as zr
    from bench_models import lm_loss
    from zeroray.comm.group import make_torch_group
    from zeroray.engine.engine import Engine
    from zeroray.memory.report import measure

    group = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    engine = Engine(model_fn(spec), lm_loss, PATHS[path], zr.ZeroConfig(stage=stage), group, seed=spec.seed)
    assert engine.whole_params == (path == "whole")
    spent = {"opt": 0.0}
    step = engine.optimizer.step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        step(*args, **kwargs)
        spent["opt"] += time.perf_counter() - t0
    engine.optimizer.step = timed_step
    rows = []
    for batch in global_batches(spec):
        spent["opt"] = 0.0
        t0 = time.perf_counter()
        engine.train_step(worker_slice(batch, rank, spec))
        rows.append({"step": time.perf_counter() - t0, "opt": spent["opt"],
                     "bytes": float(group.counter.total_bytes)})
    report = measure(engine)
    out = {k: statistics.median(r[k] for r in rows[spec.warmup_steps:]) for k in rows[0]}
    out["state_bytes"] = float(sum(t.numel() * t.element_size() for t in engine.optimizer.state_tensors()))
    out["exchange_bytes"] = float(report.get("whole_params", {}).get("exchange_step_bytes", 0))
    out["imbalance"] = float(report.get("whole_params", {}).get("owner_imbalance", 1.0))
    engine.close()
    group.close()
    return out


def _cost_rank(rank: int, world: int, ports: list, rows: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    spec = BenchSpec(num_workers=world, timed_steps=8)
    results = [_cost_row(rank, world, port, spec, stage, path) for port, (stage, path) in zip(ports, rows)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def cost(rounds: int) -> None:
    from tests.dist.harness import spawn_ranks
    from zeroray.comm.port import free_ports

    world = 2
    rows = [(stage, path) for _ in range(rounds) for stage in STAGES for path in PATHS]
    out_dir = tempfile.mkdtemp(prefix="zr-optimizer-paths-")
    ports = free_ports(len(rows))
    spawn_ranks(_cost_rank, world, (world, ports, rows), out_dir, join_s=None)
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    spec = BenchSpec(num_workers=world)
    print(f"model {spec.model} d_model {spec.d_model} x {spec.n_layers} layers, {world} workers, fp32, "
          f"{rounds} round(s), medians of rank 0's timed steps")
    print("stage  path    step s  opt s   sent MiB  state MiB (rank 0, 1)  exchange MiB in a step  owner imbalance")
    table = {}
    for stage in STAGES:
        for path in PATHS:
            mine = [i for i, row in enumerate(rows) if row == (stage, path)]
            med = {k: statistics.median(ranks[0][i][k] for i in mine) for k in ("step", "opt", "bytes")}
            state = [statistics.median(ranks[r][i]["state_bytes"] for i in mine) for r in range(world)]
            exchange = ranks[0][mine[0]]["exchange_bytes"]
            table[(stage, path)] = {**med, "state": max(state), "exchange": exchange}
            print(f"{stage:>5}  {path:<6} {med['step']:7.3f} {med['opt']:7.3f} {med['bytes'] / 2**20:9.1f}  "
                  f"{state[0] / 2**20:8.2f} {state[1] / 2**20:8.2f}           {exchange / 2**20:8.2f}             "
                  f"{ranks[0][mine[0]]['imbalance']:.3f}")
    print("whole/flat: stage  step   opt    sent   state (the larger rank's)")
    for stage in STAGES:
        w, f = table[(stage, "whole")], table[(stage, "flat")]
        print(f"            {stage:>5}  {w['step'] / f['step']:.3f}  {w['opt'] / f['opt']:.2f}  "
              f"{w['bytes'] / f['bytes']:.3f}  {w['state'] / f['state']:.3f}")


def _table_specs():
    import zeroray as zr
    from tests.batchnorm_models import class_loss, conv_bn, image_batches, sync_conv_bn
    from tests.real_models import hf_gpt2, real_batches, real_loss
    from tests.whole_param_optimizers import adafactor, muon_adamw

    batches = real_batches(TABLE_STEPS)
    specs = {}
    for name, fn in (("Adafactor", adafactor), ("Muon + AdamW", muon_adamw)):
        for stage in (0, 1, 2, 3):
            for when, spec in (("before", zr.elementwise(fn)), ("after", fn)):
                specs[(name, stage, when)] = (2, dict(model_fn=hf_gpt2, loss_fn=real_loss, optimizer=spec,
                                                      zero=zr.ZeroConfig(stage=stage), batches=batches))
    for stage in (0, 1, 2, 3):  # before: what a SyncBatchNorm was on the workers, a per-worker BatchNorm
        for when, bn_model in (("before", conv_bn), ("after", sync_conv_bn)):
            specs[("SyncBatchNorm", stage, when)] = (2, dict(
                model_fn=bn_model, loss_fn=class_loss, optimizer=zr.AdamW(**BN_ADAMW), zero=zr.ZeroConfig(stage=stage),
                batches=image_batches(TABLE_STEPS)))
    return specs


TABLE_STEPS = 5
BN_ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _diff(losses, params, ref, buffers=()):
    """The largest relative loss difference over the steps, the largest absolute difference of the
    final parameters (and of the buffers, when named)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref[0]))
    worst = {True: 0.0, False: 0.0}
    for k, v in ref[2].items():
        got = params[k].reshape(v.shape).to(v.dtype)
        worst[k in buffers] = max(worst[k in buffers], (got.double() - v.double()).abs().max().item())
    return f"loss {loss:.1e}, params {worst[False]:.1e}" + (f", buffers {worst[True]:.1e}" if buffers else "")


def table() -> None:
    from tests.batchnorm_models import class_loss, conv_bn, image_batches
    from tests.dist.harness import run_engine_table
    from tests.dist.test_engine_parity import global_losses
    from tests.models import reference_run
    from tests.real_models import hf_gpt2, real_batches, real_loss
    from tests.whole_param_optimizers import adafactor, muon_adamw, trainable

    batches = real_batches(TABLE_STEPS)
    runs = run_engine_table(_table_specs())
    print(f"2 workers, fp32, {TABLE_STEPS} steps, against single-process torch with the same optimizer and global "
          "batches (loss: largest relative difference over the steps; params, buffers: largest absolute difference "
          "at the end). Adafactor and Muon + AdamW: GPT-2 (transformers, tiny config); SyncBatchNorm: two "
          "conv-BatchNorm2d blocks converted by convert_sync_batchnorm, AdamW, against plain BatchNorm on the "
          "global batch")
    print("| recipe | | stage 0 | stage 1 | stage 2 | stage 3 | torch against itself, reordered |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = [(name, hf_gpt2, real_loss, lambda m, fn=fn: fn(trainable(m)), batches, ())
            for name, fn in (("Adafactor", adafactor), ("Muon + AdamW", muon_adamw))]
    bn_buffers = {n for n, _ in conv_bn().named_buffers()}
    rows.append(("SyncBatchNorm", conv_bn, class_loss, lambda m: torch.optim.AdamW(m.parameters(), **BN_ADAMW),
                 image_batches(TABLE_STEPS), bn_buffers))
    for name, model, loss_fn, make, data, buffers in rows:
        ref = reference_run(model, loss_fn, make, data)
        # micro-batches are no mere reordering for BatchNorm: each normalises by its own rows
        reordered = None if buffers else reference_run(model, loss_fn, make, data, accum=2)
        for when in ("before", "after"):
            cells = [_diff(global_losses(runs[(name, s, when)][0]), runs[(name, s, when)][1], ref, buffers)
                     for s in range(4)]
            last = _diff(reordered[0], reordered[2], ref) if when == "after" and reordered else ""
            print(f"| {name} | {when} | " + " | ".join(cells) + f" | {last} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost", action="store_true", help="step time and memory, whole-parameter path / flat, Adam")
    parser.add_argument("--table", action="store_true", help="issue 41's table before and after")
    parser.add_argument("--rounds", type=int, default=1, help="--cost: every row this many times (medians)")
    args = parser.parse_args(argv)
    if not args.cost and not args.table:
        args.cost = args.table = True
    if args.cost:
        cost(args.rounds)
    if args.table:
        table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
