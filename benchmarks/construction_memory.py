"""Peak memory while building a large model: whole in one process vs sharded over W workers (stage 3).

    python benchmarks/construction_memory.py                   # GPT d_model 2048, 8 layers: 403M params, 1.6 GB fp32
    python benchmarks/construction_memory.py --model hf-gpt2   # transformers GPT2LMHeadModel, 1024 wide, 24 layers: 355M
    python benchmarks/construction_memory.py --workers 4 --engine

Each build runs in a freshly spawned process with one thread. The figure is the growth of
the process's peak resident set (``ru_maxrss``) over its baseline right after importing
torch, zeroray (and transformers' model class) and one tiny sharded build (which imports
torch's meta and dispatch machinery once; reported apart), i.e. what building the model cost at its
worst moment:
- whole: ``torch.manual_seed(seed); model_fn()`` in one process;
- sharded: W processes at once, rank r calling ``zeroray.construct.sharded_init.build_sharded(model_fn,
  seed, W, r)`` (what a stage-3 worker does first): a meta pass for the structure, then the
  real construction in which each parameter's memory is freed once registered and brought
  back for every op that touches it ([Note: sharded construction]); the Hugging Face model
  initialises every child from the root (``post_init``), so it exercises exactly that;
- ``--engine``: also the whole stage-3 ``Engine`` construction over a gloo group of W
  processes (sharded build + fp32 master/parameter shard + gradient shard; Adam's state is
  allocated at the first step), for comparison with what training then holds.
The stated bound is the shard plus about the largest parameter (plus buffers); the table
prints both terms. MB = 1e6 bytes.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from queue import Empty

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULTS = {"gpt": dict(d_model=2048, layers=8, heads=16), "hf-gpt2": dict(d_model=1024, layers=24, heads=16)}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _build_gpt(d_model, layers, heads):
    from examples import gpt

    return gpt.GPT(gpt.GPTConfig(d_model=d_model, n_layers=layers, n_heads=heads))


def _build_hf_gpt2(d_model, layers, heads):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=d_model, n_layer=layers, n_head=heads))


def _model_fn(model, shape):
    if model == "hf-gpt2":
        import transformers
        from transformers import GPT2LMHeadModel  # noqa: F401 - imported before the baseline

        transformers.logging.set_verbosity_error()
        return functools.partial(_build_hf_gpt2, **shape)
    return functools.partial(_build_gpt, **shape)


def _loss(model, batch):
    out = model(batch)
    logits = out if hasattr(out, "reshape") else out.logits
    return logits.float().mean()


def _child(kind, model, shape, world, rank, port, queue):
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(1)
    import zeroray as zr
    from zeroray.construct.sharded_init import build_sharded

    model_fn = _model_fn(model, shape)
    # The first sharded build imports torch's meta and dispatch-mode machinery (tens of MB,
    # once per process): paid before the baseline by every kind, and reported apart.
    before = _rss_now()
    build_sharded(functools.partial(torch.nn.Linear, 2, 2), 0, world, rank)
    out_import = _rss_now() - before
    base_now = _rss_now()
    out = {"kind": kind, "rank": rank, "import_bytes": out_import}
    start = time.perf_counter()
    if kind == "whole":
        torch.manual_seed(0)
        built = model_fn()
        out["held_bytes"] = sum(p.numel() * p.element_size() for p in built.parameters())
    elif kind == "sharded":
        built = build_sharded(model_fn, 0, world, rank)
        if built is None:
            raise RuntimeError("the model fell back to a whole build (see the warning above)")
        _, layout, kept = built
        out["held_bytes"] = sum(v.numel() * v.element_size() for _, _, v in kept.values())
        out["largest_module_bytes"] = max(u.numel for u in layout.units) * 4
        out["largest_param_bytes"] = max(s.numel for s in layout.slots.values()) * 4
    else:  # engine
        from zeroray.comm.group import make_torch_group
        from zeroray.engine.engine import Engine

        group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=600)
        base_now = _rss_now()
        start = time.perf_counter()
        engine = Engine(model_fn, _loss, zr.AdamW(lr=1e-3), zr.ZeroConfig(stage=3), group)
        out["held_bytes"] = engine.master.numel() * 4 + engine.grad.numel() * 4
        group.close()
    out["time_s"] = time.perf_counter() - start
    # Against the current RSS at the baseline: ru_maxrss may still hold an import-time transient.
    out["peak_growth"] = _peak_rss() - base_now
    out["now_growth"] = _rss_now() - base_now
    queue.put(out)


def _run(kind, model, shape, world, ranks):
    import multiprocessing as mp

    from zeroray.comm.port import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(kind, model, shape, world, r, port, queue)) for r in ranks]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1))
        except Empty:  # a failed child puts nothing: notice it instead of waiting forever
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{kind} rank process failed with exit code {failed[0]}") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{kind} rank process failed with exit code {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])


def _row(label, r, extra):
    return (f"{label:24} {r['peak_growth'] / 1e6:16,.0f} {r['now_growth'] / 1e6:10,.0f} "
            f"{extra / 1e6:12,.0f} {r['time_s']:8.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt")
    p.add_argument("--d-model", type=int, help="width (default: 2048 gpt, 1024 hf-gpt2)")
    p.add_argument("--layers", type=int, help="layers (default: 8 gpt, 24 hf-gpt2)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 16)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--engine", action="store_true", help="also measure the stage-3 Engine construction")
    args = p.parse_args(argv)
    shape = dict(DEFAULTS[args.model])
    for key, value in (("d_model", args.d_model), ("layers", args.layers), ("heads", args.heads)):
        if value is not None:
            shape[key] = value
    from zeroray.memory.model import count_params

    n = count_params(_model_fn(args.model, shape))
    W = args.workers
    print(f"{args.model} d_model {shape['d_model']}, {shape['layers']} layers: {n:,} parameters, "
          f"{4 * n / 1e6:,.0f} MB in fp32; {W} workers, stage 3. "
          "Peak RSS growth over the post-import baseline, MB = 1e6 B\n")
    whole = _run("whole", args.model, shape, 1, [0])[0]
    sharded = _run("sharded", args.model, shape, W, range(W))
    print(f"{'build':24} {'peak RSS growth':>16} {'RSS after':>10} {'kept':>12} {'time s':>8}")
    print(_row("whole, 1 process", whole, whole["held_bytes"]))
    for r in sharded:
        print(_row(f"sharded, rank {r['rank']}", r, r["held_bytes"]))
    shard = max(r["held_bytes"] for r in sharded)
    largest = sharded[0]["largest_param_bytes"]
    worst = max(r["peak_growth"] for r in sharded)
    print(f"\nshard {shard / 1e6:,.0f} MB; largest parameter {largest / 1e6:,.0f} MB (largest module "
          f"{sharded[0]['largest_module_bytes'] / 1e6:,.0f} MB); bound shard + largest parameter "
          f"{(shard + largest) / 1e6:,.0f} MB; worst sharded peak {worst / 1e6:,.0f} MB = "
          f"{worst / whole['peak_growth']:.1%} of the whole build")
    print(f"(not counted above: the first sharded build in a process imports torch's meta and dispatch "
          f"modules, {max(r['import_bytes'] for r in sharded) / 1e6:,.0f} MB once)")
    if args.engine:
        engine = _run("engine", args.model, shape, W, range(W))
        print(f"\n{'stage-3 Engine(...)':24} {'peak RSS growth':>16} {'RSS after':>10} {'master+grad':>12} "
              f"{'time s':>8}")
        for r in engine:
            print(_row(f"engine, rank {r['rank']}", r, r["held_bytes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
