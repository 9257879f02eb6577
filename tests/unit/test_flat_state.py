"""[Note: flat optimizer state] (zeroray/engine/flat_state.py): after each update the inner
optimizer's per-element state tensors are views of one flat tensor per key, which the export
returns (live) or copies, and the state stays bitwise what the same torch optimizer keeps over
separate parameters: after splits for unused parameters, with a piece that never got state,
with a state tensor replaced out of place (the export then gathers the pieces), and across an
import.
"""
import pytest
import torch

import zeroray as zr
from zeroray.engine.optim import Segment, ShardedOptimizer

SPANS = {"a": (0, 4), "b": (4, 7), "c": (7, 10)}
SEGMENTS = [Segment(0, 4, ()), Segment(4, 10, (("lr", 0.05),))]
SPECS = {"adamw-fused": zr.AdamW(lr=1e-2, weight_decay=0.1), "sgd": zr.SGD(lr=1e-2, momentum=0.9),
         "adamw-single": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=False),
         "adam-amsgrad-foreach": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True, foreach=True)}


def _pair(spec, start):
    """This package's optimizer over a flat 10-element master, and the same torch optimizer over
    parameters a, b, c (a in the first param group, b and c in the second, as the segments)."""
    flat = ShardedOptimizer(spec, start.clone(), torch.zeros(10), SEGMENTS, None, param_spans=SPANS)
    params = {n: torch.nn.Parameter(start[a:b].clone()) for n, (a, b) in SPANS.items()}
    ref = (spec.build if hasattr(spec, "build") else spec)([{"params": [params["a"]]}, {"params": [params["b"], params["c"]], "lr": 0.05}])
    return flat, ref, params


def _step(flat, ref, params, grad, unused=()):
    flat.grad.copy_(grad)
    flat.step(norm=1.0, unused=list(unused))
    for n, (a, b) in SPANS.items():
        params[n].grad = None if n in unused else grad[a:b].clone()
    ref.step()


def _ref_flat(ref, params, key):
    """``key`` of the torch optimizer laid end to end, zeros for a parameter without state."""
    return torch.cat([ref.state[params[n]][key] if params[n] in ref.state else torch.zeros(b - a)
                      for n, (a, b) in SPANS.items()])


def _keys(flat):
    return sorted({k for s in flat.inner.state.values() for k, v in s.items() if v.dim() > 0})


@pytest.mark.parametrize("name", list(SPECS))
def test_state_lives_in_one_flat_and_equals_torch(name):
    torch.manual_seed(0)
    start = torch.randn(10)
    flat, ref, params = _pair(SPECS[name], start)
    # b unused in the first two steps (it has no state yet: its region must export as zeros), c in the fourth
    plan = [("b",), ("b",), (), ("c",), ()]
    for i, unused in enumerate(plan):
        _step(flat, ref, params, torch.randn(10), unused)
        keys = _keys(flat)
        assert keys, name
        tensors, _ = flat.export_state(live=True)
        copies, _ = flat.export_state()
        for key in keys:
            home = flat.flat_state.flats[key]
            for pc in flat.pieces.pieces:  # every piece's state is the view of the flat at its offset
                state = flat.inner.state.get(pc.param)
                if state:
                    assert state[key].untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
                    assert state[key].storage_offset() == home.storage_offset() + pc.start
            assert tensors[f"optim.{key}"] is home  # live: the flat itself, no copy
            assert copies[f"optim.{key}"].data_ptr() != home.data_ptr()
            want = _ref_flat(ref, params, key)
            assert torch.equal(tensors[f"optim.{key}"], want), (name, i, key)
            assert torch.equal(copies[f"optim.{key}"], want), (name, i, key)
    assert torch.equal(flat.master, torch.cat([params[n].detach() for n in SPANS]))


def test_a_state_tensor_replaced_out_of_place_is_gathered():
    torch.manual_seed(1)
    flat, ref, params = _pair(SPECS["adamw-fused"], torch.randn(10))
    _step(flat, ref, params, torch.randn(10))
    first = flat.inner.state[flat.flat_params[0]]
    first["exp_avg"] = first["exp_avg"] + 1  # no longer the flat's view
    tensors, _ = flat.export_state(live=True)
    assert tensors["optim.exp_avg"] is not flat.flat_state.flats["exp_avg"]
    assert torch.equal(tensors["optim.exp_avg"], _ref_flat(ref, params, "exp_avg") + torch.tensor([1.0] * 4 + [0.0] * 6))
    _step(flat, ref, params, torch.randn(10))  # the update re-homes it
    assert flat.export_state(live=True)[0]["optim.exp_avg"] is flat.flat_state.flats["exp_avg"]


def test_import_then_steps_continue_bitwise():
    """An import replaces the state (the flats are dropped): the export before the next update
    gathers the pieces, the update re-homes, and the run continues as the original."""
    torch.manual_seed(2)
    grads = [torch.randn(10) for _ in range(6)]
    original, _, _ = _pair(SPECS["adamw-fused"], torch.randn(10))
    for g in grads[:3]:
        original.grad.copy_(g)
        original.step(norm=1.0, unused=["b"])
    restored, _, _ = _pair(SPECS["adamw-fused"], torch.zeros(10))
    restored.master.copy_(original.master)
    restored.import_state(*original.export_state())
    assert not restored.flat_state.flats
    for key, value in original.export_state()[0].items():
        assert torch.equal(restored.export_state()[0][key], value), key
    for g in grads[3:]:
        for opt in (original, restored):
            opt.grad.copy_(g)
            opt.step(norm=1.0)
    assert torch.equal(restored.master, original.master)
    (a, _), (b, _) = original.export_state(), restored.export_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert restored.export_state(live=True)[0]["optim.exp_avg"] is restored.flat_state.flats["exp_avg"]


@pytest.mark.parametrize("name", ["adamw-fused", "adamw-single", "adam-amsgrad-foreach"])
def test_one_segment_over_the_whole_shard_is_its_own_flat(name):
    # One segment (stage 0, or an optimizer without per-group options): the piece's state tensor,
    # made by the optimizer at its first update, becomes the key's flat as it is. Moving it into a
    # new flat held the key twice at that update (the step's peak; benchmarks/README.md).
    torch.manual_seed(0)
    start = torch.randn(10)
    opt = ShardedOptimizer(SPECS[name], start.clone(), torch.zeros(10), [Segment(0, 10, ())], None,
                           param_spans=SPANS)
    made = {}
    opt.inner.register_step_post_hook(lambda o, args, kwargs: made.update(
        {k: v.data_ptr() for s in o.state.values() for k, v in s.items() if v.dim() > 0}))
    opt.grad.copy_(torch.randn(10))
    opt.step(norm=1.0)
    flats = opt.flat_state.flats
    assert sorted(flats) == _keys(opt) and made.keys() == flats.keys()
    assert all(flats[k].data_ptr() == made[k] for k in flats)  # no second copy of any key
    tensors, _ = opt.export_state(live=True)
    assert all(tensors[f"optim.{k}"] is flats[k] for k in flats)
    ref = (SPECS[name].build if hasattr(SPECS[name], "build") else SPECS[name])(
        [{"params": [p := torch.nn.Parameter(start.clone())]}])
    p.grad = opt.grad.clone()
    ref.step()
    for k in flats:
        assert torch.equal(flats[k], ref.state[p][k]), k
