"""Peak memory while building a large model: whole in one process vs sharded over W workers (stage 3).

    python benchmarks/construction_memory.py                   # GPT d_model 2048, 8 layers: 403M params, 1.6 GB fp32
    python benchmarks/construction_memory.py --workers 4 --engine

Each build runs in a freshly spawned process with one thread. The figure is the growth of
the process's peak resident set (``ru_maxrss``) over its baseline right after importing
torch and zeroray (peak ``ru_maxrss`` minus the RSS at that point), i.e. what building the
model cost at its worst moment:
- whole: ``torch.manual_seed(seed); model_fn()`` in one process;
- sharded: W processes at once, rank r calling ``zeroray.sharded_init.build_sharded(model_fn,
  seed, W, r)`` (what a stage-3 worker does first): a meta pass for the structure, then the
  real construction that keeps each module's slice as soon as the module is built
  ([Note: sharded construction]);
- ``--engine``: also the whole stage-3 ``Engine`` construction over a gloo group of W
  processes (sharded build + fp32 master/parameter shard + gradient shard; Adam's state is
  allocated at the first step), for comparison with what training then holds.
MB = 1e6 bytes.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _child(kind, cfg_kwargs, world, rank, port, queue):
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(1)
    import zeroray as zr
    from examples import gpt
    from zeroray.sharded_init import build_sharded

    model_fn = functools.partial(gpt.GPT, gpt.GPTConfig(**cfg_kwargs))
    base_now = _rss_now()
    out = {"kind": kind, "rank": rank}
    if kind == "whole":
        torch.manual_seed(0)
        model = model_fn()
        out["held_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    elif kind == "sharded":
        model, layout, kept = build_sharded(model_fn, 0, world, rank)
        out["held_bytes"] = sum(v.numel() * v.element_size() for _, _, v in kept.values())
        out["largest_module_bytes"] = max(u.numel for u in layout.units) * 4
    else:  # engine
        from zeroray.comm.group import make_torch_group
        from zeroray.engine import Engine

        group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=600)
        base_now = _rss_now()
        engine = Engine(model_fn, gpt.gpt_loss, zr.AdamW(lr=1e-3), zr.ZeroConfig(stage=3), group)
        out["held_bytes"] = engine.master.numel() * 4 + engine.grad.numel() * 4
        group.close()
    # Against the current RSS at the baseline: ru_maxrss may still hold an import-time transient.
    out["peak_growth"] = _peak_rss() - base_now
    out["now_growth"] = _rss_now() - base_now
    queue.put(out)


def _run(kind, cfg_kwargs, world, ranks):
    import multiprocessing as mp

    from zeroray.comm.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(kind, cfg_kwargs, world, r, port, queue)) for r in ranks]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{kind} rank process failed with exit code {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--engine", action="store_true", help="also measure the stage-3 Engine construction")
    args = p.parse_args(argv)
    cfg_kwargs = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    from examples import gpt
    from zeroray.memory import count_params

    n = count_params(functools.partial(gpt.GPT, gpt.GPTConfig(**cfg_kwargs)))
    W = args.workers
    print(f"GPT d_model {args.d_model}, {args.layers} layers: {n:,} parameters, {4 * n / 1e6:,.0f} MB in fp32; "
          f"{W} workers, stage 3. Peak RSS growth over the post-import baseline, MB = 1e6 B\n")
    whole = _run("whole", cfg_kwargs, 1, [0])[0]
    sharded = _run("sharded", cfg_kwargs, W, range(W))
    print(f"{'build':24} {'peak RSS growth':>16} {'RSS after':>10} {'kept':>10}")
    print(f"{'whole, 1 process':24} {whole['peak_growth'] / 1e6:16,.0f} {whole['now_growth'] / 1e6:10,.0f} "
          f"{whole['held_bytes'] / 1e6:10,.0f}")
    for r in sharded:
        print(f"{'sharded, rank ' + str(r['rank']):24} {r['peak_growth'] / 1e6:16,.0f} {r['now_growth'] / 1e6:10,.0f} "
              f"{r['held_bytes'] / 1e6:10,.0f}")
    largest = sharded[0]["largest_module_bytes"]
    worst = max(r["peak_growth"] for r in sharded)
    print(f"\nlargest module (one unit) {largest / 1e6:,.0f} MB; shard {sharded[0]['held_bytes'] / 1e6:,.0f} MB; "
          f"worst sharded peak = {worst / whole['peak_growth']:.1%} of the whole build")
    if args.engine:
        engine = _run("engine", cfg_kwargs, W, range(W))
        print(f"\n{'stage-3 Engine(...)':24} {'peak RSS growth':>16} {'RSS after':>10} {'master+grad':>12}")
        for r in engine:
            print(f"{'engine, rank ' + str(r['rank']):24} {r['peak_growth'] / 1e6:16,.0f} "
                  f"{r['now_growth'] / 1e6:10,.0f} {r['held_bytes'] / 1e6:12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
