"""Where a stage-3 worker's resident memory goes, step by step: the engine alone, as a Ray worker runs it.

    python benchmarks/offload_steps.py LAYERS ZERO_JSON STEPS OUT   # e.g. 29 '{"offload":"disk"}' 3 /tmp/s29
    STAGE=1 python benchmarks/offload_steps.py ...                      # another stage (default 3)

Two gloo processes, fits.py's GPT (d_model 512, 8 heads, 64 tokens x 2 sequences per worker), each
building the engine with ProcessMemory.build and stepping it on ProcessMemory's compute thread, as
runtime/worker does. After construction and after each step: RSS, the kernel's peak over the steps
(VmHWM), glibc's arenas (``mallinfo2``: bytes from the OS, free, in mapped blocks, in use) and
/proc/self/smaps' resident bytes by kind; between two steps, each anonymous mapping whose resident
bytes changed by more than 1 MB (a 64 MiB-aligned one of about 64 MB is a thread arena's heap). Rank
0 also samples its RSS every 2 ms and, at each new high, records the compute thread's stack (where
the peak is). Then memory_report's breakdown ([Note: RSS breakdown] in zeroray/memory/report.py).
Writes OUT.<rank>.json and prints both ranks.
"""
import ctypes
import json
import os
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in ("benchmarks", "examples", ""):
    sys.path.insert(0, os.path.join(ROOT, p))
import torch
import torch.multiprocessing as mp

class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MI

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def mi():
    m = libc.mallinfo2()
    return {"arena": m.arena / 1e6, "free": m.fordblks / 1e6, "mmap": m.hblkhd / 1e6, "inuse": m.uordblks / 1e6}

def smaps():
    out = {"heap": 0, "anon": 0, "file": 0, "stack": 0}
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                cur = parts[5] if len(parts) > 5 else ""
            elif parts[0] == "Rss:":
                kb = int(parts[1]) * 1024 / 1e6
                key = ("heap" if cur == "[heap]" else "stack" if cur.startswith("[stack") else
                       "anon" if cur == "" else "file")
                out[key] += kb
    return {k: round(v, 1) for k, v in out.items()}

def maps_detail():
    out, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                cur = (parts[0], (b - a) / 1e6, parts[5] if len(parts) > 5 else "")
            elif parts[0] == "Rss:":
                kb = int(parts[1]) * 1024 / 1e6
                if kb > 0.5 and (cur[2] == "" or cur[2] == "[heap]"):
                    out[cur[0]] = [round(cur[1], 1), round(kb, 1), cur[2]]
    return out

def rank_main(rank, world, port, layers, fields, steps, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import zeroray as zr
    from bench_models import lm_loss
    from common import BenchSpec, model_fn, global_batches, worker_slice
    from zeroray.comm.group import make_torch_group
    from zeroray.engine.engine import Engine
    from zeroray.memory.process import ProcessMemory
    from zeroray.memory.report import measure
    spec = BenchSpec(d_model=512, n_layers=layers, n_heads=8, seq_len=64, batch_per_worker=2, num_workers=world,
                     threads=1, warmup_steps=0, timed_steps=steps)
    group = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    memory = ProcessMemory()
    state = {"best": 0, "peaks": [], "step": -1, "stop": False, "trace": []}
    compute = {}

    def sampler():
        while not state["stop"]:
            r = rss()
            if r > state["best"] + 2e6:
                state["best"] = r
                fr = sys._current_frames().get(compute.get("id"))
                frames = traceback.extract_stack(fr)[-9:] if fr else []
                st = [f"{s.filename.split('/')[-1]}:{s.lineno} {s.name}" for s in frames]
                state["peaks"].append({"step": state["step"], "rss": r / 1e6, "mi": mi(), "stack": st})
            time.sleep(0.002)

    engine = memory.build(Engine, model_fn(spec), lm_loss, zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                          zr.ZeroConfig(stage=int(os.environ.get("STAGE", 3)), **fields), group, seed=spec.seed)
    memory.step(lambda: compute.setdefault("id", threading.get_ident()))
    after_build = {"rss": rss() / 1e6, "mi": mi(), "smaps": smaps()}
    if rank == 0:
        threading.Thread(target=sampler, daemon=True).start()
    per_step = []
    for i, batch in enumerate(global_batches(spec)):
        state["step"] = i
        state["best"] = 0 if i == 0 else state["best"]
        memory.step(engine.train_step, worker_slice(batch, rank, spec))
        per_step.append({"step": i, "rss": rss() / 1e6, "hwm": memory.report()["step_peak_rss"] / 1e6,
                         "mi": mi(), "smaps": smaps(), "detail": maps_detail()})
    state["stop"] = True
    rep = measure(engine, memory.report())
    res = {"rank": rank, "after_build": after_build, "per_step": per_step, "peaks": state["peaks"][-8:],
           "rss_report": {k: (v / 1e6 if isinstance(v, (int, float)) else v) for k, v in rep["rss"].items()},
           "offload": engine.offload_stats() if hasattr(engine, "offload_stats") else None}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f, indent=1)
    engine.close()
    group.close()


def main() -> None:
    layers, fields, steps, out = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, layers, fields, steps, out), nprocs=2)
    for r in range(2):
        d = json.load(open(f"{out}.{r}.json"))
        print(f"rank {r}: after build", d["after_build"])
        for s in d["per_step"]:
            print("  step", {k: v for k, v in s.items() if k != "detail"})
        for i in range(1, len(d["per_step"])):
            a, b = d["per_step"][i - 1]["detail"], d["per_step"][i]["detail"]
            ch = sorted(((b.get(k, [0, 0])[1] - a.get(k, [0, 0])[1], k, b.get(k) or a.get(k)) for k in set(a) | set(b)),
                        reverse=True)
            print(f"  step {i - 1} -> {i}: mappings that changed >1 MB:",
                  [(round(x, 1), k, v) for x, k, v in ch if abs(x) > 1])
        print("  report", {k: round(v, 1) if isinstance(v, float) else v for k, v in d["rss_report"].items()})
        for p in d["peaks"][-4:]:
            print("  peak", p["step"], round(p["rss"], 1), p["mi"], "\n     ", " <- ".join(reversed(p["stack"][-6:])))


if __name__ == "__main__":
    main()
