"""py-spy of rank 0's Ray worker while zr.Trainer trains compare.py's model (issue 30's profiles).

    STEPS=25 PYTHONPATH=. python benchmarks/spy_worker.py STAGE MODEL out.txt   # raw (collapsed) py-spy samples
    python benchmarks/spy_summary.py out.txt "stage 1"                          # shares of the step

Records at 200 Hz with idle samples after 3 warm-up steps and prints the median Ray hops per step.
"""
import os, subprocess, sys, time
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "benchmarks"))
from common import BenchSpec, global_batches
from zr_run import ZeroraySession
stage, model, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = BenchSpec(model=model, warmup_steps=3, timed_steps=int(os.environ.get("STEPS", "25")))
s = ZeroraySession()
runs = s.open_runs({"r": (stage, None)}, spec, prefetch=True)
run = runs["r"]
pids = [i["pid"] for i in run.trainer.controller.group.nodes]
batches = list(global_batches(spec))
for b in batches[:3]:
    run.step(b)
print("pids", pids, flush=True)
spy = subprocess.Popen(["py-spy", "record", "--idle", "-r", "200", "-o", out, "--format", "raw", "-p", str(pids[0])],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.0)
t0 = time.perf_counter()
hops = []
for b in batches[3:]:
    t1 = time.perf_counter()
    r = run.trainer.step(b)
    wall = time.perf_counter() - t1
    tl = r.timeline or {}
    if tl:
        hops.append((wall, tl["actor_start"] - tl["submit"], tl["engine_start"] - tl["actor_start"],
                     tl["engine_end"] - tl["engine_start"], tl["receive"] - tl["engine_end"]))
dt = (time.perf_counter() - t0) / (len(batches) - 3)
import statistics
if hops:
    med = [statistics.median(h[i] for h in hops) * 1e3 for i in range(5)]
    print("median ms: wall %.1f  submit->actor %.1f  actor->engine %.1f  engine %.1f  engine_end->receive %.1f" % tuple(med), flush=True)
spy.send_signal(2); spy.wait()
print(f"stage {stage} {model}: {dt:.3f} s/step (under py-spy)", flush=True)
run.close(); s.close()
