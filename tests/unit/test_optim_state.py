"""Where ShardedOptimizer.import_state puts each state tensor (restore and resize).

The bug this guards against showed on a GPU only: restoring a checkpoint into an engine on
``cuda:0`` left Adam's ``step`` on the CPU, and fused Adam refused it. The CPU suite cannot
move anything to CUDA, so the parameters here live on the ``meta`` device: a device other
than the CPU, on which optimizers can be built and state can be loaded (no step runs). A
state tensor that stays on the CPU there would have stayed on the CPU next to a CUDA
parameter too. See [Note: state placement] in zeroray/engine/optim.py.
"""
import pytest
import torch

import zeroray as zr
from zeroray.engine.optim import Segment, ShardedOptimizer

SEGMENTS = [Segment(0, 4, ()), Segment(4, 10, (("lr", 0.1),))]


def _optimizer(spec, device="cpu") -> ShardedOptimizer:
    master = torch.zeros(10, device=device)  # 1D fp32 shard
    grad = torch.zeros(10, device=device)    # 1D fp32 shard
    return ShardedOptimizer(spec, master, grad, SEGMENTS, None, None)


def _saved_adam_state():
    tensors = {"optim.exp_avg": torch.arange(10.0), "optim.exp_avg_sq": torch.arange(10.0) + 1}
    scalars = {"optim.step": 3.0, "group_lr": {SEGMENTS[1].key: 0.05}}
    return tensors, scalars


def _placement(opt: ShardedOptimizer):
    return [{k: (v.device, v.dtype) for k, v in opt.inner.state[p].items()} for p in opt.flat_params]


def test_fused_adam_step_goes_to_the_parameter_device():
    """The H200 failure: fused AdamW (zeroray's default kernel) wants ``step`` beside the params."""
    opt = _optimizer(zr.AdamW(lr=1e-3), device="meta")
    assert opt.inner.param_groups[0]["fused"]
    opt.import_state(*_saved_adam_state())
    meta = (torch.device("meta"), torch.float32)
    assert _placement(opt) == [{"exp_avg": meta, "exp_avg_sq": meta, "step": meta}] * 2


def test_capturable_adam_step_goes_to_the_parameter_device():
    opt = _optimizer(lambda groups: torch.optim.Adam(groups, capturable=True, foreach=False), device="meta")
    opt.import_state(*_saved_adam_state())
    assert all(s["step"] == (torch.device("meta"), torch.float32) for s in _placement(opt))


def test_plain_adam_step_stays_a_cpu_float32_scalar():
    """Without fused/capturable torch keeps ``step`` on the CPU (a host scalar, no device sync)."""
    opt = _optimizer(lambda groups: torch.optim.AdamW(groups, fused=False, foreach=False), device="meta")
    opt.import_state(*_saved_adam_state())
    meta = (torch.device("meta"), torch.float32)
    assert _placement(opt) == [{"exp_avg": meta, "exp_avg_sq": meta, "step": (torch.device("cpu"), torch.float32)}] * 2


def test_learning_rates_and_values_are_restored():
    opt = _optimizer(zr.AdamW(lr=1e-3))
    tensors, scalars = _saved_adam_state()
    opt.import_state(tensors, scalars)
    assert [g["lr"] for g in opt.inner.param_groups] == [1e-3, 0.05]
    first, second = (opt.inner.state[p] for p in opt.flat_params)
    assert torch.equal(first["exp_avg"], torch.arange(4.0))
    assert torch.equal(second["exp_avg_sq"], torch.arange(4.0, 10.0) + 1)
    assert float(second["step"]) == 3.0
    # The optimizer owns its state: nothing aliases the caller's tensors.
    tensors["optim.exp_avg"].fill_(-1)
    assert torch.equal(first["exp_avg"], torch.arange(4.0))


@pytest.mark.parametrize("spec", [zr.AdamW(lr=1e-2, weight_decay=0.1), zr.Adam(lr=1e-2), zr.SGD(lr=1e-2, momentum=0.9)],
                         ids=["adamw", "adam", "sgd"])
def test_export_import_continues_like_the_original(spec):
    """Round trip on the CPU: the restored optimizer's next steps equal the original's, bit for bit."""
    torch.manual_seed(0)
    grads = [torch.randn(10) for _ in range(5)]
    start = torch.randn(10)

    def run(opt, steps):
        for g in steps:
            opt.grad.copy_(g)
            opt.step(norm=1.0)

    original = _optimizer(spec)
    original.master.copy_(start)
    run(original, grads[:3])
    restored = _optimizer(spec)
    restored.master.copy_(original.master)
    restored.import_state(*original.export_state())
    assert _placement(restored) == _placement(original)
    run(original, grads[3:])
    run(restored, grads[3:])
    assert torch.equal(restored.master, original.master)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_restore_steps_on_cuda():
    """The failing path itself: export -> import into a new engine on CUDA -> train_step."""
    from tests.models import lm_loss, make_batches, parity_model
    from zeroray.comm.group import SoloGroup
    from zeroray.engine.engine import Engine

    batches = make_batches(3)

    def engine():
        return Engine(parity_model, lm_loss, zr.AdamW(lr=1e-2), zr.ZeroConfig(stage=3), SoloGroup(), device="cuda")

    first = engine()
    first.train_step(batches[0])
    state = first.export_state()
    first.close()
    second = engine()
    second.import_state(*state)
    second.train_step(batches[1])
    steps = {k: v.device.type for k, v in second.optimizer.inner.state[second.optimizer.flat_params[0]].items()}
    second.close()
    assert steps == {"exp_avg": "cuda", "exp_avg_sq": "cuda", "step": "cuda"}


# Three parameters in two segments (the second with an lr override); "b" is never used, "c" and
# "a" are left unused in some steps ([Note: unused parameters] in zeroray/engine/flat_pieces.py).
SPANS = {"a": (0, 3), "b": (3, 6), "c": (6, 10)}
GROUPED = [Segment(0, 6, ()), Segment(6, 10, (("lr", 0.05),))]
UNUSED = [("b",), ("b", "c"), ("a", "b"), ("b",), ("b", "c"), ("b",)]
SPECS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": zr.AdamW(lr=1e-2, weight_decay=0.1),
    "sgd-dampening": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.5, weight_decay=0.1),
}


def _halving(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)


def _sharded(spec):
    return ShardedOptimizer(spec, torch.zeros(10), torch.zeros(10), GROUPED, None, _halving, param_spans=SPANS)


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_unused_parameters_are_skipped_like_torch_and_survive_export(spec):
    """Each parameter steps exactly as a torch parameter whose .grad is None when unused (no
    update, no weight decay, no step, no state), through an LR scheduler and a group override;
    an export/import in the middle (per-element steps, no state for "b") changes nothing."""
    builder = spec.build if hasattr(spec, "build") else spec
    torch.manual_seed(0)
    start = torch.randn(10)
    grads = [torch.randn(10) for _ in UNUSED]
    ref = {n: torch.nn.Parameter(start[a:b].clone()) for n, (a, b) in SPANS.items()}
    ref_opt = builder([{"params": [ref["a"], ref["b"]]}, {"params": [ref["c"]], "lr": 0.05}])
    ref_sched = _halving(ref_opt)
    original = _sharded(spec)
    original.master.copy_(start)
    restored = None
    for i, (g, unused) in enumerate(zip(grads, UNUSED)):
        for n, (a, b) in SPANS.items():
            ref[n].grad = None if n in unused else g[a:b].clone()
        ref_opt.step()
        ref_sched.step()
        for opt in (original, restored) if restored else (original,):
            opt.grad.copy_(g)
            opt.step(norm=1.0, unused=unused)
        if i == 2:
            restored = _sharded(spec)
            restored.master.copy_(original.master)
            tensors, scalars = original.export_state()
            sgd = isinstance(original.inner, torch.optim.SGD)  # SGD keeps no scalar state
            assert scalars["optim_per_element"] == ([] if sgd else ["step"])
            restored.import_state(tensors, scalars)
    want = torch.cat([ref[n].detach() for n in SPANS])
    assert torch.equal(original.master, want), (original.master - want).abs().max()
    assert torch.equal(restored.master, want), (restored.master - want).abs().max()
    for opt in (original, restored):
        assert opt.param_state("b") is None  # never updated: torch keeps no state either
        assert [g["lr"] for g in opt.inner.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        for n in ("a", "c"):
            state, ref_state = opt.param_state(n), ref_opt.state[ref[n]]
            assert set(state) == set(ref_state)
            for key, value in ref_state.items():
                assert torch.equal(state[key].reshape(value.shape), value), (n, key)
    assert len(original.flat_params) == 3 and len(original.inner.param_groups) == 2


@pytest.mark.parametrize("spec", [zr.AdamW(lr=1e-2), zr.SGD(lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_a_rank_whose_parameters_were_never_updated_exports_the_same_keys(spec):
    """Every rank must write the same keys (checkpoint commit, resharding): a rank holding only
    parameters no step used has no state to read them from, and exports its peers' keys, as
    zeros (no state), which import back as no state."""
    spans = {"head": (0, 10)}
    busy = ShardedOptimizer(spec, torch.zeros(10), torch.ones(10), [Segment(0, 10, ())], None,
                            param_spans={"used": (0, 10)})
    idle = ShardedOptimizer(spec, torch.zeros(10), torch.ones(10), [Segment(0, 10, ())], None, param_spans=spans)
    for _ in range(2):
        busy.step(1.0, unused=["head"])
        idle.step(1.0, unused=["head"])
    assert idle.param_state("head") is None
    (busy_tensors, busy_scalars), (tensors, scalars) = busy.export_state(), idle.export_state()
    assert sorted(tensors) == sorted(busy_tensors) and scalars.keys() == busy_scalars.keys()
    assert scalars["optim_per_element"] == busy_scalars["optim_per_element"]
    assert all(not t.any() for t in tensors.values())
    restored = ShardedOptimizer(spec, torch.zeros(10), torch.ones(10), [Segment(0, 10, ())], None, param_spans=spans)
    restored.import_state(tensors, scalars)
    assert restored.param_state("head") is None and restored.uneven
