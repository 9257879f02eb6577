"""Fuzz cases end to end: build them, run them on the engine, run their oracles, judge them.

The oracles run in this process while the ranks run the cases (the ranks spend most of that
time starting up). ``run_seeds`` returns one ``Outcome`` per seed, in order.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional

from tests.conformance.case import Case, make_case
from tests.conformance.compare import Verdict, judge
from tests.conformance.oracle import Reference, reference_run, reorder_spread
from tests.conformance.recipe import REORDER_BOUND
from tests.conformance.runner import run_cases


@dataclass
class Outcome:
    case: Case
    verdict: Verdict
    gaps: FrozenSet[str]   # the known gaps the case exercises (case.gaps(), plus unused per the oracle)
    fetch: Optional[Dict[str, int]] = None  # stage 3 on 2-3 workers: rank 0's negotiation rounds and plan exits

    def line(self) -> str:
        gaps = f" [known gap: {','.join(sorted(self.gaps))}]" if self.gaps else ""
        case = self.case
        return f"seed {case.seed}: {self.verdict.kind}{gaps}\n    {case.describe()}\n    rerun: {case.rerun()}"


def run_seeds(seeds: Iterable[int], without: FrozenSet[str] = frozenset(), chunk: int = 40,
              max_world: int = 3) -> List[Outcome]:
    cases = [make_case(s, without, max_world=max_world) for s in seeds]
    return run_case_list(cases, chunk=chunk)


def run_case_list(cases: List[Case], chunk: int = 40) -> List[Outcome]:
    """In process sets of ``chunk`` cases (a process that dies loses one chunk's results)."""
    out: List[Outcome] = []
    for lo in range(0, len(cases), chunk):
        part = cases[lo:lo + chunk]
        refs: Dict[int, Optional[Reference]] = {}
        spreads: Dict[int, Dict[str, float]] = {}
        errors: Dict[int, str] = {}

        def oracles() -> None:
            for i, case in enumerate(part):
                try:
                    refs[i] = reference_run(case)
                    if case.config.optimizer in REORDER_BOUND and case.config.precision == "fp32":
                        spreads[i] = reorder_spread(case, refs[i])
                except Exception:  # noqa: BLE001 - a case the oracle cannot run is reported as such
                    errors[i] = traceback.format_exc()
        results = run_cases(part, while_running=oracles)
        for i, (case, got) in enumerate(zip(part, results)):
            verdict = judge(case, refs.get(i), got, errors.get(i), spreads.get(i))
            gaps = set(case.gaps())
            ref = refs.get(i)
            if ref is not None and any(ref.unused):
                gaps.add("unused")
            fetch = None
            if case.config.zero["stage"] == 3 and case.config.world > 1 and got.error is None:
                fetch = got.per_rank[0]["fetch"]
            out.append(Outcome(case, verdict, frozenset(gaps), fetch))
    return out
