"""The ``zeroray`` command: ``estimate`` (the paper's memory model), ``plan`` (the step
simulator of zeroray.plan: memory, step time and the stage per cluster), ``inspect`` and
``consolidate`` (checkpoint tools, implemented in zeroray.checkpoint), ``export-hf`` (a
checkpoint as a Hugging Face model directory, implemented in zeroray.hf).

Every subcommand returns an exit status: 0 on success, 2 for bad arguments, with the
reason on stderr. Importing this module imports neither torch nor ray, so ``zeroray
estimate --params ...`` answers instantly.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Callable, List, Optional, Sequence

from zeroray.memory import model as memory

GB = 1e9  # the paper's GB
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class _UsageError(Exception):
    """A bad argument found after parsing; reported like an argparse error (exit 2)."""


# --- argument types ----------------------------------------------------------------------------


def _param_count(text: str) -> float:
    """7.5e9, 7500000000, 7.5B, 350M, 1.2T."""
    body, scale = text.strip(), 1.0
    if body and body[-1].lower() in _SUFFIXES:
        body, scale = body[:-1], _SUFFIXES[body[-1].lower()]
    try:
        value = float(body) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: write e.g. 7.5e9 or 7.5B")
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: it must be > 0")
    return value


def _worker_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of worker counts: write e.g. 1,4,16,64")
    return values


def _optimizer(text: str):
    if text.isdigit():
        return int(text)
    if text.lower() not in memory.OPTIMIZER_STATE_FLOATS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an optimizer: choose one of {', '.join(memory.OPTIMIZER_STATE_FLOATS)} "
            "or give the fp32 state values per parameter as an integer")
    return text.lower()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be an integer >= 1")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _byte_size(text: str) -> int:
    """5GB (10^9 bytes, as transformers' max_shard_size counts), 5GiB (2^30), 500MB, 1000000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _BYTE_UNITS or int(float(match.group(1)) * _BYTE_UNITS[unit]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 5GB, 5GiB, 500MB or a number "
                                         "of bytes (>= 1)")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be a number > 0")
    return value


# --- formatting --------------------------------------------------------------------------------


def _fmt(value: float) -> str:
    # One decimal like the paper; small values keep three significant digits instead of "0.0".
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.3g}"


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(columns)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [title] + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# --- estimate ----------------------------------------------------------------------------------


def _estimate(args: argparse.Namespace) -> int:
    # Check everything before printing, so a bad call prints no half report.
    shape = {"layers": args.layers, "hidden": args.hidden, "seq_len": args.seq_len, "batch": args.batch}
    want_activations = any(v is not None for v in shape.values()) or args.heads is not None
    missing = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is None]
    if want_activations and missing:
        raise _UsageError(f"activation memory needs --layers, --hidden, --seq-len and --batch; "
                          f"missing {', '.join(missing)}")
    if args.model is not None:
        # Console scripts do not put the working directory on sys.path; `python -m` does.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        num_params = memory.count_params(args.model)
        source = f"{args.model}: {num_params:,} params"
    else:
        num_params = int(round(args.params))
        source = f"{num_params / 1e9:.3g}B params"
    stages = memory.STAGES
    k = memory.optimizer_state_bytes_per_param(args.optimizer, args.dtype)
    precision = "fp32" if args.dtype == "fp32" else f"{args.dtype} mixed precision"
    header = ["workers"] + [f"stage {s}" for s in stages]
    rows = [[str(n)] + [_fmt(memory.estimate_memory(num_params, n, s, args.dtype, args.optimizer,
                                                    args.grad_dtype, offload=args.offload) / GB) for s in stages]
            for n in args.workers]
    where = {None: "", "disk": "; offload=disk: the optimizer state (and in mixed precision or at stage 3 the "
                               "fp32 master, at stage 3 the parameter shard) in files, three 16 MiB chunks in memory",
             "cpu": "; offload=cpu, on paper (not built yet): the disk tier's layout in host memory, what stays "
                    "on the device"}[args.offload]
    print(_table(f"Model states per worker, GB ({source}, {precision}, optimizer {args.optimizer}, "
                 f"K={k}{where})", header, rows))
    if args.memory_gb is not None:
        rows = [[str(n)] + [_fmt(memory.max_params_that_fit(args.memory_gb * GB, n, s, args.dtype,
                                                            args.optimizer, args.grad_dtype, args.offload) / 1e9)
                            for s in stages] for n in args.workers]
        print()
        print(_table(f"Largest model that fits in {args.memory_gb:g} GB per worker, billions of params "
                     "(model states only)", header, rows))
    if want_activations:
        print()
        print(_activation_table(args, shape))
    return 0


def _activation_table(args: argparse.Namespace, shape: dict) -> str:
    def gb(**kw) -> str:
        return _fmt(memory.activation_bytes(**shape, heads=args.heads, dtype=args.dtype, **kw) / GB)

    full, ckpt, offload = gb(), gb(checkpointing=True), gb(checkpointing=True, offload=True)
    rows = [[str(n), full, ckpt, gb(checkpointing=True, partitioned_over=n), offload]
            for n in args.workers]
    attention = "" if args.heads is not None else "; no --heads: attention scores not stored"
    return _table(f"Activation memory per worker, GB (micro-batch {args.batch} per worker, "
                  f"seq {args.seq_len}{attention})",
                  ["workers", "none", "checkpointed", "partitioned", "offloaded"], rows)


# --- checkpoint tools (zeroray.checkpoint) -----------------------------------------------------


def _checkpoint_tool(name: str) -> Optional[Callable[..., int]]:
    try:
        # Imported on use: the checkpoint package pulls in torch and safetensors.
        return getattr(importlib.import_module("zeroray.checkpoint"), name)
    except (ImportError, AttributeError) as e:
        print(f"zeroray: the checkpoint tools are not available in this installation "
              f"(zeroray.checkpoint.{name}: {e})", file=sys.stderr)
        return None


def _inspect(args: argparse.Namespace) -> int:
    tool = _checkpoint_tool("cli_inspect")
    return 2 if tool is None else int(tool(args.ckpt))


def _consolidate(args: argparse.Namespace) -> int:
    tool = _checkpoint_tool("cli_consolidate")
    return 2 if tool is None else int(tool(args.ckpt, args.out))


def _export_hf(args: argparse.Namespace) -> int:
    try:
        # Imported on use: zeroray.hf pulls in torch (and transformers when it runs).
        tool = importlib.import_module("zeroray.hf").cli_export_hf
    except (ImportError, AttributeError) as e:
        print(f"zeroray: export-hf is not available in this installation (zeroray.hf: {e})", file=sys.stderr)
        return 2
    return int(tool(args.ckpt, args.out, args.config, args.max_shard_size, args.dtype))


# --- entry point -------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    import json

    from zeroray import plan as planner
    from zeroray.plan.report import format_plan

    changes = {"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}
    if args.gpu_memory:
        changes["memory_bytes"] = float(args.gpu_memory)
    cluster = planner.cluster_preset(args.gpu, **changes)
    seq = args.seq_len
    if args.hf_config:
        w = planner.from_hf_config(args.hf_config, seq)
    elif args.model:
        w = planner.model_preset(args.model, seq)
    elif args.params:
        w = planner.from_params(args.params, seq_len=seq or 1024)
    elif not args.largest:
        raise _UsageError("give a model: --params N, --model PRESET or --hf-config config.json (or --largest)")
    else:
        w = None
    kw = dict(dtype=args.dtype, micro_batch=args.micro_batch, tp=args.tp, checkpointing=not args.no_checkpointing,
              optimizer=args.optimizer, offload=args.offload)
    if w is None:
        out = {"largest": planner.largest_models(cluster, args.gpus, seq_len=seq or 1024, margin=0.0, **kw),
               "largest_states_only": {str(s): memory.max_params_that_fit(cluster.memory_bytes, args.gpus, s,
                                                                          args.dtype, args.optimizer,
                                                                          offload=args.offload)
                                       for s in memory.STAGES},
               "gpus": args.gpus, "gpu": cluster.name, "gpu_memory_gb": cluster.memory_bytes / GB}
    else:
        out = planner.plan(w, cluster, args.gpus, accum=args.accum, margin=args.margin, **kw)
    print(json.dumps(out, indent=1) if args.json else format_plan(out))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroray", description="ZeRO sharded training on Ray: tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    est = sub.add_parser("estimate", help="model-state and activation memory per worker (ZeRO paper)",
                         description="Bytes per worker of parameters, gradients and optimizer state "
                                     "for ZeRO stages 0-3 (1 GB = 1e9 bytes, as in the paper).")
    what = est.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_param_count, help="number of parameters, e.g. 7.5e9 or 7.5B")
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="count the parameters of the model this zero-argument function builds")
    est.add_argument("--workers", type=_worker_list, default=[1, 4, 16, 64],
                     help="comma-separated worker counts (default 1,4,16,64)")
    est.add_argument("--dtype", choices=tuple(memory.DTYPE_BYTES), default="fp16",
                     help="fp16/bf16: mixed precision with fp32 master weights; fp32: plain fp32")
    est.add_argument("--grad-dtype", choices=tuple(memory.DTYPE_BYTES), default=None,
                     help="gradient dtype when it differs from --dtype")
    est.add_argument("--optimizer", type=_optimizer, default="adam",
                     help="adam, adamw, sgd, sgd_momentum, or fp32 state values per parameter")
    est.add_argument("--offload", choices=("disk", "cpu"), default=None,
                     help="where the optimizer state lives: disk (ZeroConfig(offload='disk')), or cpu (GPU host "
                          "memory; on paper, not built yet)")
    est.add_argument("--memory-gb", type=_positive_float, default=None,
                     help="also show the largest model whose model states fit in this many GB")
    act = est.add_argument_group("activations (all four of --layers, --hidden, --seq-len, --batch)")
    act.add_argument("--layers", type=_positive_int)
    act.add_argument("--hidden", type=_positive_int)
    act.add_argument("--seq-len", type=_positive_int)
    act.add_argument("--batch", type=_positive_int, help="micro-batch per worker")
    act.add_argument("--heads", type=_positive_int, help="attention heads (omit for flash attention)")
    est.set_defaults(handler=_estimate)

    pl = sub.add_parser("plan", help="predicted memory, step time and MFU per stage on a cluster",
                        description="Replays the engine's schedule on paper (docs/planning.md): per stage, "
                                    "memory per GPU, whether it fits, step time, tokens/s, MFU, the recommended "
                                    "bucket size and window, and the largest model that fits.")
    model = pl.add_mutually_exclusive_group()
    model.add_argument("--params", type=_param_count, help="a GPT-shaped model of this many parameters")
    model.add_argument("--hf-config", metavar="PATH", help="a Llama- or GPT-2-family config.json")
    model.add_argument("--model", metavar="PRESET", help="llama-7b, llama-13b, llama-70b, llama3-8b, llama3-70b, gpt2")
    pl.add_argument("--largest", action="store_true", help="only the largest model that fits at each stage")
    pl.add_argument("--gpus", type=_positive_int, default=8)
    pl.add_argument("--gpu", default="h100", help="h100, h200, v100-32gb or cpu (default h100)")
    pl.add_argument("--gpus-per-node", type=_positive_int, default=None)
    pl.add_argument("--gpu-memory", type=_byte_size, default=None, metavar="SIZE", help="e.g. 32GB (1e9 bytes)")
    pl.add_argument("--dtype", choices=tuple(memory.DTYPE_BYTES), default="bf16")
    pl.add_argument("--seq-len", type=_positive_int, default=None)
    pl.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per GPU per micro-batch")
    pl.add_argument("--accum", type=_positive_int, default=1, help="micro-batches per step")
    pl.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel degree inside a node")
    pl.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    pl.add_argument("--optimizer", type=_optimizer, default="adam")
    pl.add_argument("--offload", choices=("disk", "cpu"), default=None,
                    help="optimizer state on disk (ZeroConfig(offload='disk')) or in GPU host memory (cpu: on "
                         "paper, not built yet)")
    pl.add_argument("--margin", type=_positive_float, default=0.1, help="memory kept free (default 0.1)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(handler=_plan)

    ins = sub.add_parser("inspect", help="summarize a sharded checkpoint")
    ins.add_argument("ckpt", metavar="CKPT")
    ins.set_defaults(handler=_inspect)

    con = sub.add_parser("consolidate", help="write a sharded checkpoint as one full state dict")
    con.add_argument("ckpt", metavar="CKPT")
    con.add_argument("out", metavar="OUT")
    con.set_defaults(handler=_consolidate)

    hf = sub.add_parser("export-hf", help="write a sharded checkpoint as a Hugging Face model directory",
                        description="Stream the checkpoint's weights into config.json plus safetensors "
                                    "files (with model.safetensors.index.json when split), which "
                                    "transformers' from_pretrained loads.")
    hf.add_argument("ckpt", metavar="CKPT")
    hf.add_argument("out", metavar="OUT", help="output directory")
    hf.add_argument("--config", required=True, metavar="PATH",
                    help="the model's config.json, or the saved model directory holding it")
    hf.add_argument("--max-shard-size", type=_byte_size, default=5 * 2**30, metavar="SIZE",
                    help="split the weights into files of at most this size (default 5GiB; "
                         "GB = 10^9 bytes as in transformers, GiB = 2^30)")
    hf.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="dtype of the floating-point tensors written (default fp32, the master weights)")
    hf.set_defaults(handler=_export_hf)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the error (or --help)
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.handler(args)
    except (_UsageError, ValueError) as e:
        print(f"zeroray {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
