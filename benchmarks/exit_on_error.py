"""Run a driver that steps a Trainer and then raises, many times: its exit codes and what is left.

    python benchmarks/exit_on_error.py --runs 20

The script is tests/e2e/test_exit_on_error.py's (a Trainer not shut down, a user error after
one step). Each run must exit with code 1, start no Ray at exit, and leave no process of its
Ray session behind ([Note: releasing at exit] in zeroray/runtime/trainer.py). Before the fix
about one run in ten exited 139 (a segmentation fault at exit).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.e2e.test_exit_on_error import processes_mentioning, run_failing_script  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    codes: collections.Counter = collections.Counter()
    bad = 0
    for i in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="zr-exit-"))
        ray_tmp = tempfile.mkdtemp(prefix="zr-exit-ray-", dir="/tmp")
        try:
            t0 = time.monotonic()
            done = run_failing_script(work, ray_tmp)
            out = done.stdout + done.stderr
            deadline = time.monotonic() + 30
            while (left := processes_mentioning(ray_tmp)) and time.monotonic() < deadline:
                time.sleep(0.5)
            started_at_exit = "Started a local Ray instance" in out
            core_worker = "core worker at exit: True" in out
            codes[done.returncode] += 1
            ok = done.returncode == 1 and not started_at_exit and not core_worker and not left
            bad += not ok
            print(f"run {i + 1:2d}: exit {done.returncode:4d}, Ray started at exit: {started_at_exit}, core worker "
                  f"at exit: {core_worker}, processes left: {len(left)}, {time.monotonic() - t0:.1f} s"
                  + ("" if ok else "  <-- NOT OK"), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"exit codes over {args.runs} runs: {dict(codes)}; {args.runs - bad} of {args.runs} as they should be")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
