"""Parameters that a step leaves unused (issue 24): no rank produced a gradient for them, so, as
in single-process PyTorch and in torch DDP (``find_unused_parameters=True``), their ``.grad``
is None and the optimizer skips them: no update, no weight decay, no step count, no state
([Note: unused parameters] in zeroray/engine/flat_pieces.py). A parameter that some rank used gets
the average over the ranks, the others counting zero.

The model (tests/experts.py) routes each row to one of two experts by a data column and never
calls one head; the batches make the ranks (and the micro-batches) use different experts, and
some steps use neither. AdamW with weight decay: a parameter that moved when it should not
have would show. Stage 3 negotiates the steps whose ranks run different experts.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zeroray as zr
from tests.dist.harness import record_failure, run_engine_table, run_engines, spawn_ranks
from tests.dist.parity import assert_parity, global_losses, param_bound, within
from tests.experts import expert_batches, experts_model, unused_in
from tests.models import lm_loss
from zeroray.comm.port import free_port
from zeroray.engine.batch import split_batch

STEPS = 6
ADAMW = dict(lr=1e-2, weight_decay=0.1)
HEAD = ("unused_head.weight", "unused_head.bias")
CASES = [(stage, 1) for stage in range(4)] + [(0, 2), (1, 2), (3, 2)]  # (stage, grad_accum_steps)


def torch_run(batches):
    """Single-process PyTorch on the global batches: (losses, final state, each parameter's
    AdamW step count (None: no state), the parameters whose .grad was None in each step)."""
    torch.manual_seed(0)
    model = experts_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, unused = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, batch)
        loss.backward()
        unused.append({n for n, p in model.named_parameters() if p.grad is None})
        opt.step()
        losses.append(loss.item())
    steps = {n: float(opt.state[p]["step"]) if p in opt.state else None for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, steps, unused


def optimizer_view(engine):
    """Per rank: the AdamW step count of every parameter it holds (None: no state), and how
    many segments its optimizer was built with and flat pieces it steps now."""
    opt = engine.optimizer
    steps = {}
    for name in engine.layout.param_names:
        if name in opt.pieces.index:
            state = opt.param_state(name)
            steps[name] = float(state["step"]) if state else None
    return {"steps": steps, "segments": len(opt.segments), "pieces": len(opt.flat_params)}


def check_like_torch(ref, results, params):
    """Losses and parameters as torch's (the existing tolerance), the never-used head bit for
    bit at its initial values, and each parameter's step count as torch's on every rank.
    Returns the largest (relative loss, absolute parameter) differences."""
    losses, state, steps, _ = ref
    assert_parity((losses, None, state), results, params)
    torch.manual_seed(0)
    initial = experts_model().state_dict()
    for name in HEAD:
        assert torch.equal(params[name], initial[name].reshape(-1)), f"{name} moved"
        assert steps[name] is None
    # Used with a zero gradient: torch updates it (weight decay) and counts its steps.
    assert steps["zero_gate"] == STEPS
    assert not torch.equal(params["zero_gate"], initial["zero_gate"])
    for r, res in enumerate(results):
        held = res["inspect"]["steps"]
        assert held, f"rank {r} holds no parameter"
        for name, step in held.items():
            assert step == steps[name], f"rank {r}, {name}: step {step}, torch {steps[name]}"
    loss = max(abs(a - b) / abs(b) for a, b in zip(global_losses(results), losses))
    return loss, max((params[k].reshape(v.shape) - v).abs().max().item() for k, v in state.items())


WORLDS = (2, 3)


def _case_batches(world):
    return {k: expert_batches(STEPS, world * k) for k in {k for _, k in CASES}}


# test_save_after_skipped_steps_and_restore_at_another_size: saved after SPLIT steps at 3 workers, on
# batches of 6 parts (routes that differ between the ranks at 3 and at 2 workers)
SPLIT = 3


def _checkpoint_batches():
    return expert_batches(STEPS, 6)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("unused-checkpoint"))


@pytest.fixture(scope="module")
def module_runs(checkpoint_root):
    """Every case of CASES at both world sizes, and the checkpoint's save (under
    ``checkpoint_root``), in one set of 3 processes (process start-up dominates)."""
    table = {(world, i): (world, dict(model_fn=experts_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                                      zero=zr.ZeroConfig(stage=stage, grad_accum_steps=k),
                                      batches=_case_batches(world)[k], inspect=optimizer_view))
             for world in WORLDS for i, (stage, k) in enumerate(CASES)}
    table[("save",)] = (3, dict(model_fn=experts_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                                zero=zr.ZeroConfig(stage=3), batches=_checkpoint_batches()[:SPLIT],
                                inspect=_save(checkpoint_root)))
    return run_engine_table(table)


@pytest.fixture(scope="module")
def engine_runs(module_runs):
    """world -> (batches by grad_accum_steps, every case of CASES at ``world`` workers)."""
    return lambda world: (_case_batches(world), [module_runs[(world, i)] for i in range(len(CASES))])


@pytest.mark.parametrize("world", WORLDS)
def test_unused_parameters_train_exactly_as_in_torch(engine_runs, world):
    batches, runs = engine_runs(world)
    refs = {k: torch_run(b) for k, b in batches.items()}
    for k, ref in refs.items():  # the data does what the plan says: some steps leave experts unused
        assert ref[3] == [unused_in(b) for b in batches[k]]
        assert any(len(u) > len(HEAD) for u in ref[3])
    for (stage, k), (results, params) in zip(CASES, runs):
        try:
            diffs = check_like_torch(refs[k], results, params)
            if stage == 3:  # the ranks ran different experts: those steps were negotiated
                assert any(rep["fetch"].get("rounds", 0) for rep in results[0]["reports"])
        except AssertionError as e:
            raise AssertionError(f"stage {stage}, grad_accum_steps={k}, {world} workers: {e}") from None
        pieces = [f'{r["inspect"]["segments"]}->{r["inspect"]["pieces"]}' for r in results]
        print(f"{world} workers, stage {stage}, grad_accum_steps={k}: loss rel {diffs[0]:.1e}, params "
              f"{diffs[1]:.1e}; segments->pieces per rank {pieces}")


def _save(root):
    def save(engine):
        from zeroray.checkpoint import write_shard

        state = engine.export_state()
        return write_shard(root, engine.step_count, engine.rank, *state), engine.layout.to_dict(), state
    return save


def _restore(root):
    def restore(engine):
        from zeroray.checkpoint import load_resharded

        engine.import_state(*load_resharded(root, *engine.state_layout()))
    return restore


def _resize(old_layout, old_states):
    """A resize's transfer ([Note: resize transfer]): this rank's pieces of every old rank's state."""
    def resize(engine):
        from zeroray.layout.arena import FlatLayout
        from zeroray.runtime.worker.state_transfer import PieceAssembler, cut_pieces

        layout, rank = engine.state_layout()
        assembler = PieceAssembler(layout)
        for old_rank, (tensors, scalars) in enumerate(old_states):
            assembler.add(cut_pieces(FlatLayout.from_dict(old_layout), old_rank, tensors, scalars,
                                     [(layout.to_dict(), rank)])[0])
        engine.import_state(*assembler.state())
    return resize


def test_save_after_skipped_steps_and_restore_at_another_size(module_runs, checkpoint_root):
    """Three steps at 3 workers (stage 3, in the module's process set) leave the experts with
    different step counts and the head with no state; the checkpoint carries them per element
    ("optim.step"), and 2 workers at stages 0, 1 and 3 go on from it (and at stage 2 from a
    resize's in-memory transfer) exactly like one uninterrupted torch run."""
    from zeroray.checkpoint import commit, load_manifest

    split, root = SPLIT, checkpoint_root
    batches = _checkpoint_batches()
    ref = torch_run(batches)
    assert ref[2]["experts.0.weight"] != ref[2]["experts.1.weight"]
    results, _ = module_runs[("save",)]
    infos = [r["inspect"][0] for r in results]
    path = commit(root, split, {"layout": results[0]["inspect"][1]}, infos)
    manifest = load_manifest(path)
    assert "optim.step" in manifest.sharded_keys
    assert manifest.scalars[0]["optim_per_element"] == ["step"]
    ways = [(0, _restore(path)), (1, _restore(path)), (3, _restore(path)),
            (2, _resize(results[0]["inspect"][1], [r["inspect"][2] for r in results]))]
    specs = [dict(model_fn=experts_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                  zero=zr.ZeroConfig(stage=stage), batches=batches[split:], setup=setup, inspect=optimizer_view)
             for stage, setup in ways]
    continued = run_engines(2, specs)
    for (stage, setup), (results, params) in zip(ways, continued):
        how = f"{'resized' if setup.__name__ == 'resize' else 'restored'} to 2 workers, stage {stage}"
        try:
            diffs = check_like_torch((ref[0][split:], ref[1], ref[2], None), results, params)
            print(f"{how}: loss rel {diffs[0]:.1e}, params {diffs[1]:.1e}")
        except AssertionError as e:
            raise AssertionError(f"{how}: {e}") from None


def _ddp_rank(rank, world, port, batches, out_dir):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = experts_model()
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        none = []
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            lm_loss(ddp, split_batch(batch, world)[rank]).backward()
            none.append({n for n, p in model.named_parameters() if p.grad is None})
            opt.step()
        torch.save({"none": none, "state": model.state_dict()}, os.path.join(out_dir, f"ddp{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        record_failure(rank, out_dir)
        raise


def test_equals_torch_ddp_with_find_unused_parameters(engine_runs):
    """Torch DDP (gloo, find_unused_parameters=True) on 2 ranks: a parameter no rank used keeps
    .grad None on every rank (one used on one rank only gets the average), and zeroray's
    weights (stage 3, the negotiated path) equal DDP's."""
    world = 2
    batches, runs = engine_runs(world)
    results, params = runs[CASES.index((3, 1))]
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_ddp_rank, world, (world, free_port(), batches[1]), out_dir, join_s=120)
        ddp = [torch.load(os.path.join(out_dir, f"ddp{r}.pt")) for r in range(world)]
    for r in range(world):
        assert ddp[r]["none"] == [unused_in(b) for b in batches[1]], f"rank {r}"
    # Step 3 uses expert 1 on rank 0 only: rank 1's .grad of it is the average, not None.
    assert "experts.1.weight" not in ddp[1]["none"][3]
    worst = 0.0
    for name, want in ddp[0]["state"].items():
        err = (params[name].reshape(want.shape) - want).abs().max().item()
        worst = max(worst, err)
        within(f"{name}: max abs diff from DDP", err, *param_bound(want, None))
    print(f"zeroray stage 3 vs torch DDP, 2 ranks: max param diff {worst:.2e}")
