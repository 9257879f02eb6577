"""Run the engine in W plain torch processes (gloo), no Ray: the engine layer's test bench."""
import gc
import os
import sys
import tempfile
import traceback

import cloudpickle
import torch
import torch.multiprocessing as mp

from zeroray.comm.group import make_torch_group
from zeroray.comm.port import free_ports
from zeroray.comm.user_group import join_default_group, leave_default_group
from zeroray.engine.batch import batch_size, split_batch
from zeroray.engine.engine import Engine
from zeroray.memory.report import live_tensor_bytes, measure

def _worker(rank, world, ports, specs_blob, out_dir):
    try:
        torch.set_num_threads(1)
        specs = cloudpickle.loads(specs_blob)
        kept = []  # torch.distributed default groups destroyed: dropped at the rank's exit (see _run_rank)
        for index, (port, spec) in enumerate(zip(ports, specs)):
            spec_world = spec.get("world", world)  # a spec may use only the first ranks
            if rank < spec_world:
                _run_one(rank, spec_world, port, spec, os.path.join(out_dir, f"spec{index}_rank{rank}.pt"), kept)
    except BaseException:
        record_failure(rank, out_dir)
        raise


def _run_one(rank, world, port, spec, out_file, kept):
    if spec.get("runner"):  # a plain-torch reference, in the same processes (start-up is the cost)
        torch.save(spec["runner"](rank, world, port, spec), out_file)
        return
    timeout_s = spec.get("timeout_s", 120)  # a collective's bound: a test of a hang sets a short one
    group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=timeout_s)
    join_default_group(group, "gloo", timeout_s, rendezvous_timeout_s=120)  # as the worker's setup does
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
    losses, norms, skipped, scales, trace, reports = [], [], [], [], [], []
    for batch in spec["batches"]:
        shard = split_batch(batch, world)[rank]  # uneven where the rows do not divide, as the driver splits
        stats = engine.train_step(shard, global_rows=batch_size(batch))
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
        scales.append(stats.loss_scale)
        if spec.get("trace_params"):  # opt-in: this rank's master pieces after every step
            trace.append({name: engine.master_piece(name) for name in engine.layout.param_names})
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
    torch.save({"losses": losses, "norms": norms, "skipped": skipped, "scales": scales, "trace": trace,
                "pieces": pieces,
                "reports": reports, "memory": memory, "untrained": engine.untrained_state(),
                "buffer_dtypes": {n: b.dtype for n, b in engine.model.named_buffers()},
                "frozen_dtypes": {n: p.dtype for n, p in engine.model.named_parameters() if not p.requires_grad},
                "aliases": engine.layout.aliases(), "scale": engine.scaler.scale if engine.scaler else None,
                "inspect": spec["inspect"](engine) if spec.get("inspect") else None},
               out_file)
    engine.close()
    kept.append(leave_default_group())
    group.close()


def record_failure(rank, out_dir):
    """Inside a rank's ``except``: leave its traceback where ``spawn_ranks`` looks for it."""
    with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())


def _run_rank(target, rank, *args):
    """``target(rank, *args)``, then leave at once, running no destructors: a torch gloo process
    group can deadlock in its destructor at the rank's teardown (its worker thread needs the GIL
    to drop a Python object it captured, while the main thread holds the GIL and joins that
    thread: seen in the DDP ranks under load). What a rank produces is in its files by then. A
    target that raises leaves its traceback where ``spawn_ranks`` looks (the last of ``args`` is
    the output folder)."""
    try:
        target(rank, *args)
    except BaseException:
        record_failure(rank, args[-1])
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, world, args, out_dir, join_s):
    """Run ``target(rank, *args, out_dir)`` in ``world`` spawned processes and wait for them. A
    rank that fails writes its traceback to ``out_dir/error<rank>.txt``; any such file or
    non-zero exit raises, with every traceback, after the others are killed."""
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


def gloo_world(rank, world, port):
    """A spawned rank's torch.distributed default group over gloo (a DDP reference's), one thread."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def load_ranks(out_dir, name, world):
    """What ranks 0..world-1 saved as ``<name>_rank<r>.pt`` in ``out_dir``."""
    return [torch.load(os.path.join(out_dir, f"{name}_rank{r}.pt"), weights_only=False) for r in range(world)]


def run_engine(world, **spec):
    """Train on ``spec['batches']`` (global batches) with ``world`` ranks; returns rank results and
    the consolidated fp32 parameters (state_dict names, tied aliases included)."""
    return run_engines(world, [spec])[0]


def run_engines(world, specs):
    """Several runs in one set of processes (process start-up dominates these tests' time).
    A spec with ``"world": w`` (w <= world) runs on ranks 0..w-1 only, so one process set can
    serve several world sizes. A spec with ``"runner"`` is no engine run: each rank saves what
    ``runner(rank, world, port, spec)`` returns (a reference in plain torch), and its
    consolidated parameters are None."""
    with tempfile.TemporaryDirectory() as out_dir:
        ports = free_ports(len(specs))
        spawn_ranks(_worker, world, (world, ports, cloudpickle.dumps(specs)), out_dir, join_s=300)
        out = []
        for index in range(len(specs)):
            results = [torch.load(os.path.join(out_dir, f"spec{index}_rank{r}.pt"), weights_only=False)
                       for r in range(specs[index].get("world", world))]
            out.append((results, None if specs[index].get("runner") else consolidate(results)))
        return out


def run_engine_table(runs):
    """``{key: (world, spec)}``, every run in ONE set of ``max(world)`` processes (each on ranks
    0..world-1): ``{key: (rank results, consolidated params)}``. For a module whose tests
    parametrize over the world size: one process start-up instead of one per world size."""
    keys = list(runs)
    specs = [dict(runs[k][1], world=runs[k][0]) for k in keys]
    return dict(zip(keys, run_engines(max(runs[k][0] for k in keys), specs)))


def consolidate(results, pieces=None):
    """The fp32 parameters (flat, by state_dict name) from every rank's ``pieces`` (default: its
    pieces after the last step), and rank 0's buffers and frozen parameters."""
    pieces = pieces or [r["pieces"] for r in results]
    params = {}
    for name in pieces[0]:
        numel = max(p[name][1] for p in pieces)
        flat = torch.zeros(numel)
        for p in pieces:
            lo, hi, t = p[name]
            flat[lo:hi] = t
        params[name] = flat
    for canonical, aliases in results[0]["aliases"].items():
        for a in aliases:
            params[a] = params[canonical]
    params.update(results[0]["untrained"])
    return params


def consolidate_trace(results):
    """With ``trace_params``: the consolidated parameters after each step."""
    return [consolidate(results, [r["trace"][step] for r in results]) for step in range(len(results[0]["trace"]))]
