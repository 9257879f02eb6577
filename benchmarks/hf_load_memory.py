"""Peak memory of loading a saved Hugging Face model: each of W workers reading only its own
slices (zeroray.hf.pretrained) vs one process calling from_pretrained on the whole model.

    python benchmarks/hf_load_memory.py            # GPT-2 medium config (355M params, 1.42 GB fp32), 4 workers
    python benchmarks/hf_load_memory.py --layers 4 --workers 2 --max-shard-size 200MB

A GPT2LMHeadModel with random weights is saved with save_pretrained into a temporary
directory (by a separate process). Then, each in a freshly spawned process with one thread:
- sliced, into the shard (W processes at once): rank r builds the model on the meta device,
  takes ``FlatLayout.from_module(meta_model, W)``, allocates its fp32 shard arena
  (``layout.shard_numel`` elements, which a worker holds anyway) and calls
  ``model_fn.read_pieces({name: (lo, hi)}, out={name: view into the arena})`` for the ranges
  ``layout.param_shard_view`` gives: what the engine does after building its shard;
- sliced, as a dict (W processes at once): the same ranges with ``read_pieces`` returning new
  tensors, then copied into the arena (a second copy of the shard exists for a moment);
- whole: ``AutoModelForCausalLM.from_pretrained(dir)`` in one process. transformers 5 maps the
  file and its fp32 tensors are views of the mapping, read lazily: the first row is the peak
  right after the call, the second after every weight was read once (``p.sum()``), as the
  first forward, or an engine copying the weights into its own storage, reads them.
The figure is the growth of the process's peak resident set (``ru_maxrss``) over its RSS right
before the load (after imports and a meta-device build of the model). Files are read
through the page cache, which no process's RSS includes, except for pages a process maps:
the mapped pages from_pretrained touches count in its RSS.
MB = 1e6 bytes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _config(cfg_kwargs):
    from transformers import GPT2Config

    return GPT2Config(**cfg_kwargs)


def _save(cfg_kwargs, path, max_shard_size, queue):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config(cfg_kwargs))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    queue.put({"params": sum(p.numel() for p in model.parameters())})


def _load(kind, path, world, rank, queue):
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    from zeroray.layout.arena import FlatLayout
    from zeroray.hf import pretrained

    out = {"kind": kind, "rank": rank}
    if kind == "whole":
        with torch.device("meta"):  # the imports a build needs, as the sliced rows' meta build does
            transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
        base = _rss_now()
        t0 = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        out["seconds_lazy"] = time.perf_counter() - t0
        out["peak_growth_lazy"] = _peak_rss() - base
        with torch.no_grad():
            for p in model.parameters():  # what the first forward (or the engine's copy) does
                p.sum()
        out["seconds"] = time.perf_counter() - t0
        out["held_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        model_fn = pretrained(path)
        with torch.device("meta"):
            layout = FlatLayout.from_module(model_fn(), world)
        model_fn.info()  # the meta build read_pieces does once, outside the measured part
        base = _rss_now()
        t0 = time.perf_counter()
        shard = torch.empty(layout.shard_numel)
        views, wanted = {}, {}
        for name in layout.param_names:
            views[name], lo, hi = layout.param_shard_view(shard, name, rank)
            wanted[name] = (lo, hi)
        if kind == "into":
            model_fn.read_pieces(wanted, out=views)
        else:
            pieces = model_fn.read_pieces(wanted)
            for name, t in pieces.items():
                views[name].copy_(t)
            del pieces
        out["seconds"] = time.perf_counter() - t0
        out["held_bytes"] = shard.numel() * 4
        out["read_bytes"] = sum(hi - lo for lo, hi in wanted.values()) * 4
    # Against the current RSS at the baseline: ru_maxrss may still hold an import-time transient.
    out["peak_growth"] = _peak_rss() - base
    queue.put(out)


def _spawn(target, args_list):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for args in args_list]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__} process failed with exit code {p.exitcode}")
    return sorted(results, key=lambda r: r.get("rank", 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-shard-size", default="50GB", help="save_pretrained's split (default: one file)")
    p.add_argument("--dir", default=None, help="where to save the model (default: a temporary directory)")
    args = p.parse_args(argv)
    cfg_kwargs = dict(n_embd=args.d_model, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
                      n_positions=args.positions)
    tmp = None if args.dir else tempfile.mkdtemp(prefix="hf_load_memory_")
    path = args.dir or os.path.join(tmp, "model")
    W = args.workers
    try:
        t0 = time.perf_counter()
        n = _spawn(_save, [(cfg_kwargs, path, args.max_shard_size)])[0]["params"]
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        print(f"GPT2LMHeadModel d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}: {n:,} parameters; "
              f"saved in {time.perf_counter() - t0:.0f} s as {len(files)} safetensors file(s), {size / 1e6:,.0f} MB; "
              f"{W} workers. Peak RSS growth over the RSS before the load, MB = 1e6 B\n")
        whole = _spawn(_load, [("whole", path, 1, 0)])[0]
        rows = [("whole: from_pretrained (mapped)", {**whole, "peak_growth": whole["peak_growth_lazy"],
                                                     "seconds": whole["seconds_lazy"]}),
                ("whole: + every weight read once", whole)]
        for kind, label in (("into", "sliced into shard"), ("dict", "sliced as dict")):
            rows += [(f"{label}, rank {r['rank']}", r) for r in _spawn(_load, [(kind, path, W, r) for r in range(W)])]
        print(f"{'load':36} {'peak RSS growth':>16} {'held after':>11} {'peak/file':>10} {'seconds':>8}")
        for label, r in rows:
            print(f"{label:36} {r['peak_growth'] / 1e6:16,.0f} {r['held_bytes'] / 1e6:11,.0f} "
                  f"{r['peak_growth'] / size:10.1%} {r['seconds']:8.1f}")
        into = [r for label, r in rows if label.startswith("sliced into")]
        print(f"\nworst sliced rank (into shard): {max(r['peak_growth'] for r in into) / 1e6:,.0f} MB for a "
              f"{into[0]['held_bytes'] / 1e6:,.0f} MB shard; safetensors size {size / 1e6:,.0f} MB; "
              f"from_pretrained {whole['peak_growth'] / 1e6:,.0f} MB once every weight was read")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
