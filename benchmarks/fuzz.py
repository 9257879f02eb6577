"""The differential fuzzer: random models and configurations, zeroray's engine against PyTorch.

    python benchmarks/fuzz.py --cases 500 [--seed S] [--without buffers,unused,varshape]
    python benchmarks/fuzz.py --case SEED [--without ...] [-v]

Case ``i`` of a run has seed ``S + i``; each seed draws its model (tests/conformance/grammar.py),
its ZeroConfig and worker count (configs.py) and its batches (data.py), and is trained for
2-4 steps by the engine in plain torch processes over gloo (no Ray) and by the single-process
PyTorch oracle (oracle.py), then judged by the tolerance rule of tests/conformance/compare.py.
Prints how many cases passed and, for each failure, its seed, a one-line kind (the error, or
the first quantity that differs), the known gap it exercises if any, the case and the
command that reruns it alone, then what the cases drew (per optimizer, stage, dtype and
feature: the recipe's and the issue-24 ones). ``--without`` leaves out features of known gaps that other
branches are fixing (tests/conformance/case.py: GAPS). The fuzzer's core lives in
tests/conformance/ (the CI set there runs a fixed list of seeds); this is its command line.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.conformance.case import EXCLUDABLE, GAPS  # noqa: E402
from tests.conformance.driver import run_seeds  # noqa: E402


def _without(text: str) -> frozenset:
    names = frozenset(x for x in text.split(",") if x)
    unknown = names - set(EXCLUDABLE)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown feature(s) {sorted(unknown)}: choose from {', '.join(EXCLUDABLE)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100, help="how many cases (seeds S .. S+cases-1)")
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed S")
    parser.add_argument("--case", type=int, action="append", help="run only this seed (repeatable)")
    parser.add_argument("--without", type=_without, default=frozenset(),
                        help=f"comma-separated features to leave out: {', '.join(EXCLUDABLE)}")
    parser.add_argument("--chunk", type=int, default=40, help="cases per set of worker processes")
    parser.add_argument("--max-world", type=int, default=3, help="the most workers a case gets")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failure's traceback/numbers")
    args = parser.parse_args(argv)

    seeds = args.case or list(range(args.seed, args.seed + args.cases))
    t0 = time.perf_counter()
    outcomes = run_seeds(seeds, args.without, chunk=args.chunk, max_world=args.max_world)
    elapsed = time.perf_counter() - t0
    failures = [o for o in outcomes if not o.verdict.ok]
    passed = len(outcomes) - len(failures)
    without = f", without {','.join(sorted(args.without))}" if args.without else ""
    print(f"{passed}/{len(outcomes)} cases passed ({elapsed:.0f} s{without})")
    if args.case and not failures:
        for o in outcomes:
            print(f"seed {o.case.seed}: {o.case.describe()}  (worst loss rel {o.verdict.worst:.1e})")
    kinds = collections.Counter((_kind_class(o.verdict.kind), _gap_label(o)) for o in failures)
    if kinds:
        print("\nfailures by kind:")
        for (kind, gap), n in kinds.most_common():
            print(f"  {n:4d}  {kind}{gap}")
        print("\nfailures:")
    for o in failures:
        print(o.line())
        if args.verbose:
            print("    " + o.verdict.detail.replace("\n", "\n    "))
    worst = {}
    for o in outcomes:
        dtype = o.case.config.precision
        if o.verdict.ok and not o.gaps and o.verdict.worst >= worst.get(dtype, (0.0, None))[0]:
            worst[dtype] = (o.verdict.worst, o.case.seed)
    if worst:
        print("\nlargest loss deviation from the oracle among passing cases outside those gaps: "
              + ", ".join(f"{d} {w:.2e} (seed {s})" for d, (w, s) in sorted(worst.items())))
    fetch = [o.fetch for o in outcomes if o.fetch]
    print(f"\nstage-3 cases on 2-3 workers: {sum(1 for f in fetch)}, of which negotiated fetches: "
          f"{sum(1 for f in fetch if f['rounds'])}, left a followed trace mid-step: {sum(1 for f in fetch if f['plan_exits'])}")
    print("\ndrew: " + drawn(outcomes))
    gaps = collections.Counter(g for o in outcomes for g in o.gaps)
    if gaps:
        print("\ncases exercising the issue-24 gaps (" + "; ".join(f"{g}: {n}, {GAPS[g][1]}" for g, n in sorted(gaps.items()))
              + ")")
    return 1 if failures else 0


def drawn(outcomes) -> str:
    """What the cases drew, counted: optimizers, stages, dtypes, worker counts and features."""
    counts = {k: collections.Counter() for k in ("optimizer", "stage", "dtype", "workers", "feature")}
    for o in outcomes:
        case, config = o.case, o.case.config
        counts["optimizer"][config.optimizer] += 1
        counts["stage"][f"stage{config.zero['stage']}"] += 1
        counts["dtype"][config.precision] += 1
        counts["workers"][f"W{config.world}"] += 1
        features = {k for k in ("sync_bn", "dist_loss") if getattr(case.model, k)}
        features |= {"sync_bn-W>1"} if case.model.sync_bn and config.world > 1 else set()
        features |= {"offload_disk"} if config.zero.get("offload") == "disk" else set()
        features |= {"param_groups"} if config.groups else set()
        features |= {f"issue24:{g}" for g in o.gaps}
        features |= {"issue24:2+ together"} if len(o.gaps) >= 2 else set()
        counts["feature"].update(features)
    return "; ".join(f"{what}: " + ", ".join(f"{k} {n}" for k, n in sorted(c.items())) for what, c in counts.items())


def _kind_class(kind: str) -> str:
    """The kind without what varies from case to case (which step, which parameter)."""
    words = kind.split()
    if kind.startswith(("param ", "buffer ")):
        return f"{words[0]} differs"
    if " at step " in kind:
        return kind.split(" at step ")[0] + (" (" + kind.split(" (")[1] if " (>" in kind else "")
    kind = re.sub(r"\bstep \d+: ", "", kind)
    cut = min((i for i in (kind.find("{"), kind.find("[")) if i > 0), default=len(kind))
    return kind[:cut].rstrip()


def _gap_label(outcome) -> str:
    return f"  [issue-24 gap: {','.join(sorted(outcome.gaps))}]" if outcome.gaps else ""


if __name__ == "__main__":
    sys.exit(main())
