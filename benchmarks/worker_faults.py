"""Each zeroray worker's CPU seconds and minor page faults per step, through Ray (issue 30's mha faults).

    PYTHONPATH=. python benchmarks/worker_faults.py mha:0,mha:1,mha:2      # MODEL:STAGE rows, one after another
    PYTHONPATH=/work/main python benchmarks/worker_faults.py mha:0          # another checkout's zeroray in the workers
    STEPS=20 PYTHONPATH=. python benchmarks/worker_faults.py gpt:0,mha:0

Per row, a fresh zr.Trainer of compare.py's defaults (2 workers, 3 warm-up steps), then STEPS (12)
timed steps; medians over them of the driver's wall time per step, each worker's process CPU
seconds (``cpu0``, ``cpu1``) and minor faults (``flt0``, ``flt1``) from /proc, and rank 0's
threads with their CPU seconds and faults (``threads0``: those above 2 ms or 10 faults). It prints
which zeroray the driver imported; the workers import the same (zr_run.py passes PYTHONPATH on).
"""
import os, sys, time, statistics, json
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "benchmarks"))
from common import BenchSpec, global_batches, proc_stat
from zr_run import ZeroraySession
def snap(pid):
    whole = proc_stat(pid)
    th = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            t = proc_stat(pid, int(tid))
            th[tid] = (t.name, t.minor_faults, t.cpu_s)
        except OSError: pass
    return whole.minor_faults, whole.cpu_s, th
rows = sys.argv[1].split(",")  # e.g. mha:0,gpt:0
steps = int(os.environ.get("STEPS", "12"))
s = ZeroraySession()
import zeroray; print("zeroray from", zeroray.__file__)
res = {}
for row in rows:
    model, stage = row.split(":")
    spec = BenchSpec(model=model, warmup_steps=3, timed_steps=steps)
    run = s.open_runs({"r": (int(stage), None)}, spec, prefetch=True)["r"]
    pids = [i["pid"] for i in run.trainer.controller.group.nodes]
    batches = list(global_batches(spec))
    for b in batches[:3]: run.step(b)
    per = []
    for b in batches[3:]:
        a = [snap(p) for p in pids]; t0 = time.perf_counter()
        run.trainer.step(b)
        wall = time.perf_counter() - t0; z = [snap(p) for p in pids]
        r = {"wall": wall}
        for k, (x, y) in enumerate(zip(a, z)):
            r[f"cpu{k}"] = y[1] - x[1]; r[f"flt{k}"] = y[0] - x[0]
            if k == 0:
                for tid, (nm, fl, c) in y[2].items():
                    if tid in x[2]:
                        r.setdefault("th", {})[f"{nm}:{tid}"] = (c - x[2][tid][2], fl - x[2][tid][1])
        per.append(r)
    med = {k: round(statistics.median(r[k] for r in per), 4) for k in per[0] if k != "th"}
    th = {}
    for r in per:
        for k, v in r["th"].items(): th.setdefault(k, []).append(v)
    med["threads0"] = {k: (round(statistics.median(c for c, _ in v), 4), statistics.median(f for _, f in v)) for k, v in th.items() if statistics.median(c for c, _ in v) > 0.002 or statistics.median(f for _, f in v) > 10}
    print(row, json.dumps(med), flush=True)
    run.close()
s.close()
