"""Where one step's time goes, per phase, for the engine alone (no Ray) and for torch DDP.

    python benchmarks/engine_phases.py ddp s1 s3 's3{"prefetch": false}' [--large]
    PROF=1 python benchmarks/engine_phases.py s3      # also cProfile rank 0's timed steps

Each argument is a row run in the same 2 spawned gloo processes, one after another: ``ddp``,
``coll`` (13 MB all-reduce / reduce-scatter / all-gather), or ``s<stage>`` optionally followed
by ZeroConfig overrides as JSON. Per row it prints rank 0's medians over the timed steps, in
seconds: fwd (loss_fn), bwd (backward with the gradient hooks), finish (the last buckets),
norm, opt, publish (stages 1-2 gather launch), total; for zeroray also ``exposed`` and ``comm``
(comm_report's exposed_s and comm_s) and the stage 3 coordinator's counters (``c_*``). Without
Ray, this separates the engine's cost from the runtime's; ``exposed`` with prefetch on and off
is the issue's "exposed communication" comparison as a median over steps.
"""
import os, sys, time, json, statistics
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples"), ROOT]
import torch, torch.multiprocessing as mp

PROFS = []
def med(xs): return statistics.median(xs)

def coll_bench(rank, world, port):
    from zeroray.comm.group import make_torch_group
    g = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    n = 13_000_000 // 4
    t = torch.randn(n); out = torch.empty(n // world); full = torch.empty(n)
    res = {}
    for name, fn in [("allreduce", lambda: g.all_reduce(t)),
                     ("reduce_scatter", lambda: g.reduce_scatter(out, t)),
                     ("all_gather", lambda: g.all_gather(full, out))]:
        ts = []
        for i in range(8):
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        res[name] = med(ts[2:])
    g.close()
    return res

def engine_run(rank, world, port, stage, spec, extra):
    from common import global_batches, worker_slice, gpt_config
    from gpt import GPT, gpt_loss
    import functools
    from zeroray.comm.group import make_torch_group
    from zeroray.engine import Engine
    from zeroray.config import ZeroConfig
    import zeroray as zr
    g = make_torch_group("gloo", rank, world, "127.0.0.1", port)
    T = {}
    def timed(name, fn):
        def w(*a, **k):
            t0 = time.perf_counter(); r = fn(*a, **k); T[name] = T.get(name, 0) + time.perf_counter() - t0; return r
        return w
    loss_fn = timed("fwd", gpt_loss)
    eng = Engine(functools.partial(GPT, gpt_config(spec)), loss_fn, zr.AdamW(lr=spec.lr, weight_decay=spec.weight_decay),
                 ZeroConfig(stage=stage, **extra), g, seed=spec.seed)
    eng.reducer.finish = timed("finish", eng.reducer.finish)
    eng.optimizer.grad_norm = timed("norm", eng.optimizer.grad_norm)
    eng.optimizer.step = timed("opt", eng.optimizer.step)
    eng._publish_params = timed("publish", eng._publish_params)
    rows = []
    for i, batch in enumerate(global_batches(spec)):
        T.clear()
        b = worker_slice(batch, rank, spec)
        prof = os.environ.get("PROF") and rank == 0 and i >= 3
        if prof:
            import cProfile; pr = cProfile.Profile(); pr.enable()
        t0 = time.perf_counter(); st = eng.train_step(b); tot = time.perf_counter() - t0
        if prof:
            pr.disable(); PROFS.append(pr)
        T["total"] = tot
        T["bwd"] = tot - sum(v for k, v in T.items() if k != "total")
        if eng.coordinator is not None:
            T.update({"c_" + k: v for k, v in eng.coordinator.stats.items()})
        T["exposed"] = g.counter.wait_s; T["comm"] = g.counter.comm_s
        rows.append(dict(T))
    eng.close(); g.close()
    if PROFS:
        import pstats, io
        st = pstats.Stats(PROFS[0]); [st.add(p) for p in PROFS[1:]]
        st.sort_stats("tottime").print_stats(25)
    return {k: med([r[k] for r in rows[3:]]) for k in rows[-1]}

def ddp_run(rank, world, port, spec):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from common import build_model, global_batches, worker_slice
    from gpt import gpt_loss
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = DDP(build_model(spec))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    rows = []
    for batch in global_batches(spec):
        b = worker_slice(batch, rank, spec)
        t0 = time.perf_counter(); opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model, b); t1 = time.perf_counter()
        loss.backward(); t2 = time.perf_counter()
        opt.step(); loss.item(); t3 = time.perf_counter()
        rows.append({"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "total": t3 - t0})
    dist.destroy_process_group()
    return {k: med([r[k] for r in rows[3:]]) for k in rows[-1]}

def main(rank, world, ports, what, out):
    torch.set_num_threads(1)
    from common import BenchSpec
    large = os.environ.get("LARGE") or "--large" in what
    spec = BenchSpec(d_model=512, n_layers=8, timed_steps=8) if large else BenchSpec(timed_steps=10)
    res = {}
    for i, w in enumerate(what):
        if w == "--large":
            continue
        if w == "coll": res[w] = coll_bench(rank, world, ports[i])
        elif w == "ddp": res[w] = ddp_run(rank, world, ports[i], spec)
        else:
            stage = int(w[1]); extra = json.loads(w[2:]) if len(w) > 2 else {}
            res[w] = engine_run(rank, world, ports[i], stage, spec, extra)
    if rank == 0:
        with open(out, "w") as f: json.dump(res, f)

if __name__ == "__main__":
    from zeroray.comm.group import free_port
    what = sys.argv[1:]
    ports = [free_port() for _ in what]
    import tempfile
    out = os.path.join(tempfile.mkdtemp(prefix="zr-phases-"), "out.json")
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=main, args=(r, 2, ports, what, out)) for r in range(2)]
    [p.start() for p in ps]; [p.join() for p in ps]
    for k, v in json.load(open(out)).items():
        print(k, {a: round(b, 4) for a, b in v.items()})
