"""Which path an optimizer takes ([Note: optimizer paths] in zeroray/engine/optim_choice.py), and
the whole-parameter path's parts, in one process (a group of one): torch's element-wise classes
under their options take the flat path and train exactly as torch does; a subclass, Adafactor,
Muon, a user's class take the whole-parameter path; a declared callable takes the flat one. The
owner map, the chunk plan, the state's keys and its disk file; a checkpoint of whole-parameter
state written by two ranks and read back at three."""
import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model, reference_run
from tests.whole_param_optimizers import Lamb, MuonAdamW, adafactor, newton_schulz_flops, trainable
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.engine.optim import ShardedOptimizer
from zeroray.engine.optim_choice import ELEMENTWISE
from zeroray.engine.param_exchange import plan_chunks
from zeroray.engine.shaped_optim import WholeParamOptimizer
from zeroray.layout.arena import FlatLayout
from zeroray.layout.owners import imbalance, owned_key, owner_loads, param_owners, split_owned_key
from zeroray.offload.param_state import ParamStateFile

STEPS = 3

# Every element-wise class of torch, under the options that change its arithmetic.
ELEMENTWISE_SPECS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "Adam-amsgrad-fused": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    "Adam-foreach-decoupled": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, foreach=True,
                                                        decoupled_weight_decay=True),
    "AdamW-maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "SGD-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam-decoupled": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "RMSprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.9),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1),
}


class AdamSubclass(torch.optim.Adam):
    """A subclass may change step: zeroray cannot know it is still element-wise."""


class UserSGD(torch.optim.Optimizer):
    """A user's own optimizer (element-wise in fact, but zeroray cannot know)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


WHOLE_SPECS = {
    "Adam subclass": lambda p: AdamSubclass(p, lr=1e-2),
    "Adafactor": adafactor,
    "Muon with AdamW": lambda p: MuonAdamW(p),
    "LAMB": lambda p: Lamb(p),
    "user class": lambda p: UserSGD(p),
}


def _train(spec, stage=1, **zero):
    engine = Engine(parity_model, lm_loss, spec, zr.ZeroConfig(stage=stage, **zero), SoloGroup())
    losses = [engine.train_step(b).loss for b in make_batches(STEPS)]
    params = {n: engine.master_piece(n)[2] for n in engine.layout.param_names}
    return engine, losses, params


def _like_torch(spec, engine_out, atol=1e-6):
    _, losses, params = engine_out
    ref_losses, _, ref_state = reference_run(parity_model, lm_loss, lambda m: spec(trainable(m)), make_batches(STEPS))
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, got in params.items():
        assert (got.reshape(ref_state[name].shape) - ref_state[name]).abs().max() <= atol, name


def _each_takes(specs, path):
    for name, spec in specs.items():
        out = _train(spec)
        try:
            assert type(out[0].optimizer) is path
            _like_torch(spec, out)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        out[0].close()


def test_every_elementwise_class_takes_the_flat_path_and_trains_as_torch():
    assert {type(spec(trainable(parity_model()))) for spec in ELEMENTWISE_SPECS.values()} == set(ELEMENTWISE)
    _each_takes(ELEMENTWISE_SPECS, ShardedOptimizer)


def test_what_zeroray_cannot_know_takes_the_whole_parameter_path():
    _each_takes(WHOLE_SPECS, WholeParamOptimizer)


@pytest.mark.parametrize("stage", [0, 3])
def test_muon_runs_its_matrix_work_as_single_process_torch(stage):
    """The Muon recipe's Newton-Schulz multiplications, counted by torch (FlopCounterMode), are
    those of single-process torch: every 2-D hidden weight whole, every step. Flat pieces would
    give Muon no matrix at all (DeepSpeed #8438), and a step that fell back to SGD none (#8441)."""
    made = []
    reference_run(parity_model, lm_loss, lambda m: made.append(MuonAdamW(trainable(m))) or made[-1],
                  make_batches(STEPS))
    engine, _, _ = _train(lambda p: MuonAdamW(p), stage=stage)
    inner = engine.optimizer.inner
    assert inner.muon_shapes == made[0].muon_shapes and len(inner.muon_shapes) == STEPS
    assert inner.muon_flops == made[0].muon_flops == sum(newton_schulz_flops(s) for s in inner.muon_shapes) > 0
    engine.close()
    flat, _, _ = _train(zr.elementwise(lambda p: MuonAdamW(p)), stage=stage)  # the flat path, forced
    assert flat.optimizer.inner.muon_flops == 0 and not flat.optimizer.inner.muon_shapes
    flat.close()


def test_declared_and_own_specs_take_the_flat_path():
    for spec in (zr.AdamW(lr=1e-2), zr.SGD(lr=0.1, momentum=0.9), zr.elementwise(lambda p: UserSGD(p))):
        engine, _, _ = _train(spec)
        assert type(engine.optimizer) is ShardedOptimizer
        engine.close()
    # Declared, so taken at its word: Adafactor on flat pieces is the silent failure, by request.
    engine, _, _ = _train(zr.elementwise(adafactor))
    assert type(engine.optimizer) is ShardedOptimizer
    assert all(v.dim() <= 1 for s in engine.optimizer.inner.state.values() for v in s.values())
    engine.close()


def test_specs_zeroray_refuses():
    with pytest.raises(ValueError, match="LBFGS re-evaluates the model through a closure"):
        _train(lambda p: torch.optim.LBFGS(p))

    def two_faced(params):
        params = list(params)
        shaped = any(p.dim() > 1 for g in params for p in (q[1] if isinstance(q, tuple) else q for q in g["params"]))
        return torch.optim.Adam(params) if shaped else torch.optim.Adafactor(params)
    with pytest.raises(ValueError, match="built Adam over the model's parameters but Adafactor over flat pieces"):
        _train(two_faced)
    with pytest.raises(ValueError, match="zeroray's own specs are element-wise already"):
        zr.elementwise(zr.AdamW())
    with pytest.raises(ValueError, match="needs a callable params -> torch.optim.Optimizer"):
        zr.elementwise(torch.optim.Adam)


def test_the_spec_sees_named_shaped_parameters_in_param_groups():
    seen = []

    def spec(groups):
        seen.append([(g.get("weight_decay"), [(n, tuple(p.shape)) for n, p in g["params"]]) for g in groups])
        return torch.optim.Adafactor(groups, lr=1e-2)

    layout_names = Engine(parity_model, lm_loss, zr.AdamW(), zr.ZeroConfig(stage=3), SoloGroup()).layout.param_names
    engine = Engine(parity_model, lm_loss, spec, zr.ZeroConfig(stage=3), SoloGroup(),
                    param_groups=lambda n, p: {"weight_decay": 0.0} if n.endswith("bias") else {})
    assert len(seen) == 2  # the probe that classified it, then the build
    assert seen[0] == seen[1]
    (wd0, first), (wd1, second) = seen[1]
    assert wd0 is None and wd1 == 0.0
    assert [n for n, _ in first + second] == [n for n in layout_names if not n.endswith("bias")] + \
        [n for n in layout_names if n.endswith("bias")]
    assert dict(first)["emb.weight"] == (13, 7)
    engine.close()


def test_owner_map_is_balanced_and_deterministic():
    layout = FlatLayout([("a", [("a.w", (100, 10)), ("a.b", (10,))]), ("b", [("b.w", (30, 10)), ("b.b", (30,))]),
                         ("c", [("c.w", (50, 10)), ("c.x", (0,))])], world_size=3)
    owners = param_owners(layout)
    assert owners == param_owners(FlatLayout.from_dict(layout.to_dict()))
    assert list(owners) == layout.param_names
    # largest first, each to the least loaded rank (ties: the lowest): a.w->0, c.w->1, b.w->2, then the
    # small ones to rank 2, the least loaded still
    assert owners == {"a.w": 0, "a.b": 2, "b.w": 2, "b.b": 2, "c.w": 1, "c.x": 2}
    assert owner_loads(layout) == [1000, 500, 340]
    assert imbalance(layout) == pytest.approx(1000 / (1840 / 3))
    assert set(param_owners(layout.with_world_size(1)).values()) == {0}


def test_chunk_plan_carries_every_parameter_once_within_the_bound():
    layout = FlatLayout([("u", [(f"p{i}", (i + 1, 3)) for i in range(12)])], world_size=3)
    owners = param_owners(layout)
    for row_elems in (1, 10, 40, 10**6):
        chunks = plan_chunks(layout, owners, 3, row_elems)
        names = [e.name for c in chunks for e in c.entries]
        assert sorted(names) == sorted(layout.param_names)
        for c in chunks:
            for owner in range(3):
                entries = [e for e in c.entries if e.owner == owner]
                used = sum(e.numel for e in entries)
                assert used <= c.row and (used <= row_elems or len(entries) == 1)
                assert [e.offset for e in entries] == [sum(x.numel for x in entries[:i]) for i in range(len(entries))]
                assert all(owners[e.name] == owner for e in entries)
    assert len(plan_chunks(layout, owners, 3, 10**6)) == 1


def test_owned_keys_name_their_parameter():
    names = {"a/b.weight", "a", "emb.weight"}
    assert split_owned_key(owned_key("a/b.weight", "exp_avg"), names) == ("a/b.weight", "exp_avg", False)
    assert split_owned_key(owned_key("a", "x/y"), names) == ("a", "x/y", False)
    assert split_owned_key(owned_key("emb.weight", "step", number=True), names) == ("emb.weight", "step", True)
    with pytest.raises(ValueError, match="names no parameter"):
        split_owned_key(owned_key("missing", "step"), names)


def test_state_file_gives_back_the_bytes_it_was_given(tmp_path):
    file = ParamStateFile(str(tmp_path), rank=0)
    values = {"row": torch.randn(5, 1), "col": torch.randn(1, 7).T.contiguous().T, "half": torch.randn(4).bfloat16(),
              "flags": torch.tensor([True, False]), "step": torch.tensor(3.0)}
    state = dict(values)
    file.put("w", state)
    assert list(state) == ["step"]  # 0-dim values stay in memory
    back = file.read_now("w")
    assert set(back) == {"row", "col", "half", "flags"}
    for k, v in back.items():
        assert v.dtype == values[k].dtype and torch.equal(v, values[k]), k
    row = torch.randn(6, 1)  # a new shape: a region of its own; the keys gone are no longer held
    file.put("w", {"row": row})
    back = file.read_now("w")
    assert set(back) == {"row"} and torch.equal(back["row"], row)
    assert file.stats()["state_bytes"] == 6 * 4
    assert not list(tmp_path.iterdir())  # unlinked while open
    file.close()


def test_whole_parameter_state_checkpoints_by_owner(tmp_path):
    """Two ranks write the state of the parameters each owns; a manifest records which file
    holds each; read back at three workers, each rank gets exactly its parameters' state."""
    from zeroray.checkpoint import ManifestFields, cli_inspect, commit, load_resharded, reshard_in_memory, write_shard

    layout = FlatLayout([("u", [("w", (4, 3)), ("b", (3,))]), ("v", [("m", (5, 2))])], world_size=2)
    owners = param_owners(layout)
    states = []
    infos = []
    for rank in range(2):
        tensors = {"master": torch.full((layout.shard_numel,), float(rank))}
        for name, owner in owners.items():
            if owner == rank:
                tensors[owned_key(name, "moment")] = torch.randn(layout.slots[name].shape)
                tensors[owned_key(name, "step", number=True)] = torch.tensor(2)
        states.append(tensors)
        infos.append(write_shard(str(tmp_path), 1, rank, tensors, {"optim_path": "whole_params", "step": 1}))
    path = commit(str(tmp_path), 1, ManifestFields(layout=layout), infos)
    new = layout.with_world_size(3)
    every = {k: v for s in states for k, v in s.items() if k != "master"}
    got_all = {}
    for rank in range(3):
        tensors, scalars = load_resharded(path, new, rank)
        owned = {k for k in tensors if k != "master"}
        mine = {n for n, r in param_owners(new).items() if r == rank}
        assert {split_owned_key(k, set(layout.param_names))[0] for k in owned} <= mine
        for k in owned:
            assert torch.equal(tensors[k], every[k]), k
        in_memory = reshard_in_memory(layout, states, new, rank)
        assert {k for k in in_memory if k != "master"} == owned
        got_all.update({k: tensors[k] for k in owned})
    assert set(got_all) == set(every)
    import io
    out = io.StringIO()
    assert cli_inspect(path, out) == 0
    assert "whole-parameter optimizer state: 6 tensors (moment, step) of 3 parameters, by owner rank:" in out.getvalue()


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (0, "bf16"), (1, "bf16"), (3, "fp32"), (3, "bf16")])
def test_offload_is_bitwise_the_run_in_memory(tmp_path, stage, dtype):
    """One worker: the state on disk (and in mixed precision or at stage 3 the master), a chunk
    per parameter, bitwise the run with everything in memory."""
    spec = lambda p: MuonAdamW(p)
    memory, losses, params = _train(spec, stage=stage, dtype=dtype)
    disk, disk_losses, disk_params = _train(spec, stage=stage, dtype=dtype, offload="disk",
                                            offload_dir=str(tmp_path), offload_chunk_bytes=256)
    assert type(disk.optimizer) is WholeParamOptimizer and disk.optimizer.disk.stats()["state_bytes"] > 0
    assert disk_losses == losses
    assert all(torch.equal(disk_params[n], params[n]) for n in params)
    for name in memory.layout.param_names:
        a, b = memory.optimizer.param_state(name), disk.optimizer.param_state(name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    tensors, _ = disk.export_state()
    ref, _ = memory.export_state()
    assert tensors.keys() == ref.keys() and all(torch.equal(tensors[k], ref[k]) for k in ref)
    memory.close()
    disk.close()


def test_export_import_continues_at_another_stage():
    """The state of one engine loaded into another of another stage continues as the first would."""
    spec = lambda p: MuonAdamW(p)
    batches = make_batches(2 * STEPS)
    straight = Engine(parity_model, lm_loss, spec, zr.ZeroConfig(stage=2), SoloGroup())
    for b in batches:
        straight.train_step(b)
    first = Engine(parity_model, lm_loss, spec, zr.ZeroConfig(stage=2), SoloGroup())
    for b in batches[:STEPS]:
        first.train_step(b)
    state = first.export_state()
    assert any(k.startswith("param_state/") for k in state[0])
    second = Engine(parity_model, lm_loss, spec, zr.ZeroConfig(stage=0), SoloGroup())
    second.import_state(*state)
    for b in batches[STEPS:]:
        second.train_step(b)
    for n in straight.layout.param_names:
        assert torch.equal(second.master_piece(n)[2], straight.master_piece(n)[2]), n
    # the other path's state is refused, saying what to do
    flat = Engine(parity_model, lm_loss, zr.AdamW(), zr.ZeroConfig(stage=2), SoloGroup())
    with pytest.raises(ValueError, match="stepped on whole parameters"):
        flat.import_state(*state)
    flat.train_step(batches[0])
    with pytest.raises(ValueError, match="element-wise optimizer stepped on flat pieces"):
        second.import_state(*flat.export_state())
