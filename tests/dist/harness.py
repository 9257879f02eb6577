"""Run the engine in W plain torch processes (gloo), no Ray: the engine layer's test bench.

A spec with ``"ddp": True`` trains torch DDP instead of the engine, in the same processes
(tests/dist/ddp_run.py): the parity tests' second reference, at the cost of its steps only."""
import gc
import os
import sys
import tempfile
import traceback

import cloudpickle
import torch
import torch.multiprocessing as mp

from tests.dist.ddp_run import train_ddp
from zeroray.comm.group import make_torch_group
from zeroray.comm.port import free_port
from zeroray.engine.batch import split_batch
from zeroray.engine.engine import Engine
from zeroray.memory.report import live_tensor_bytes, measure


def _worker(rank, world, ports, specs_blob, out_dir):
    try:
        torch.set_num_threads(1)
        specs = cloudpickle.loads(specs_blob)
        kept = []  # the DDP modules, alive until the rank exits (_run_rank says why)
        for index, (port, spec) in enumerate(zip(ports, specs)):
            spec_world = spec.get("world", world)  # a spec may use only the first ranks
            if rank < spec_world:
                out_file = os.path.join(out_dir, f"spec{index}_rank{rank}.pt")
                if spec.get("ddp"):
                    torch.save(train_ddp(rank, spec_world, port, spec, kept), out_file)
                else:
                    _run_one(rank, spec_world, port, spec, out_file)
    except BaseException:
        record_failure(rank, out_dir)
        raise


def _run_one(rank, world, port, spec, out_file):
    group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=120)
    if spec.get("host_staged"):  # several ranks on one GPU: collectives staged through the host
        from tests.staged_group import HostStagedGroup

        group = HostStagedGroup(group)
    live_before = None
    if spec.get("census"):  # opt-in: a gc walk; freezing older objects keeps it to milliseconds
        gc.collect()
        gc.freeze()
        live_before = live_tensor_bytes()
    engine = Engine(spec["model_fn"], spec["loss_fn"], spec["optimizer"], spec["zero"], group,
                    seed=spec.get("seed", 0), param_groups=spec.get("param_groups"),
                    scheduler=spec.get("scheduler"), device=spec.get("device", "cpu"))
    if spec.get("setup"):  # e.g. load a checkpoint before training
        spec["setup"](engine)
    losses, norms, skipped, reports = [], [], [], []
    for batch in spec["batches"]:
        shard = split_batch(batch, world)[rank]
        stats = engine.train_step(shard)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
        report = group.counter.as_dict()
        if engine.fetch_stats():
            report["fetch"] = engine.fetch_stats()
        report["bucket_pool"] = engine.reducer.pool_size
        report["buckets"] = engine.bucket_stats()
        report["time_s"] = stats.time_s
        reports.append(report)
    # Model-state bytes the engine holds after the last step, and (opt-in) every live tensor
    # storage the process gained since before the engine existed, as an independent check.
    memory = measure(engine)
    if live_before is not None:
        memory["live_tensor_bytes"] = live_tensor_bytes() - live_before
    pieces = {name: engine.master_piece(name) for name in engine.layout.param_names}
    torch.save({"losses": losses, "norms": norms, "skipped": skipped, "pieces": pieces,
                "reports": reports, "memory": memory, "untrained": engine.untrained_state(),
                "buffer_dtypes": {n: b.dtype for n, b in engine.model.named_buffers()},
                "frozen_dtypes": {n: p.dtype for n, p in engine.model.named_parameters() if not p.requires_grad},
                "aliases": engine.layout.aliases(), "scale": engine.scaler.scale if engine.scaler else None,
                "inspect": spec["inspect"](engine) if spec.get("inspect") else None},
               out_file)
    engine.close()
    group.close()


def record_failure(rank, out_dir):
    """Inside a rank's ``except``: leave its traceback where ``spawn_ranks`` looks for it."""
    with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())


def _run_rank(target, rank, *args):
    """``target(rank, *args)``, then leave at once, running no destructors: a torch gloo process
    group can deadlock in its destructor at the rank's teardown (its worker thread needs the GIL
    to drop a Python object it captured, while the main thread holds the GIL and joins that
    thread: seen in the DDP ranks under load). What a rank produces is in its files by then."""
    target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, world, args, out_dir, join_s):
    """Run ``target(rank, *args, out_dir)`` in ``world`` spawned processes and wait for them. A
    rank that fails writes its traceback to ``out_dir/error<rank>.txt`` (as ``_worker`` does);
    any such file or non-zero exit raises, with every traceback, after the others are killed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run_rank, args=(target, r, *args, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(join_s)
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.startswith("error")]
    if errors or any(p.exitcode != 0 for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]}):\n" + "\n".join(errors))


def run_engine(world, **spec):
    """Train on ``spec['batches']`` (global batches) with ``world`` ranks; returns rank results and
    the consolidated fp32 parameters (state_dict names, tied aliases included); for a DDP spec,
    rank 0's state dict."""
    return run_engines(world, [spec])[0]


def run_engines(world, specs):
    """Several runs in one set of processes (process start-up dominates these tests' time).
    A spec with ``"world": w`` (w <= world) runs on ranks 0..w-1 only, so one process set can
    serve several world sizes."""
    with tempfile.TemporaryDirectory() as out_dir:
        ports = [free_port() for _ in specs]
        spawn_ranks(_worker, world, (world, ports, cloudpickle.dumps(specs)), out_dir, join_s=300)
        out = []
        for index in range(len(specs)):
            results = [torch.load(os.path.join(out_dir, f"spec{index}_rank{r}.pt"), weights_only=False)
                       for r in range(specs[index].get("world", world))]
            out.append((results, results[0]["state"] if specs[index].get("ddp") else consolidate(results)))
        return out


def run_engine_table(runs):
    """``{key: (world, spec)}``, every run in ONE set of ``max(world)`` processes (each on ranks
    0..world-1): ``{key: (rank results, consolidated params)}``. For a module whose tests
    parametrize over the world size: one process start-up instead of one per world size."""
    keys = list(runs)
    specs = [dict(runs[k][1], world=runs[k][0]) for k in keys]
    return dict(zip(keys, run_engines(max(runs[k][0] for k in keys), specs)))


def consolidate(results):
    params = {}
    for name in results[0]["pieces"]:
        numel = max(r["pieces"][name][1] for r in results)
        flat = torch.zeros(numel)
        for r in results:
            lo, hi, t = r["pieces"][name]
            flat[lo:hi] = t
        params[name] = flat
    for canonical, aliases in results[0]["aliases"].items():
        for a in aliases:
            params[a] = params[canonical]
    params.update(results[0]["untrained"])
    return params
