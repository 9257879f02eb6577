"""Resharding N -> M: the plan against direct slicing of a logical vector, in memory and
through saved files. See [Note: resharding] in zeroray/checkpoint/reshard.py."""
import itertools
import os

import pytest
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint import (CheckpointError, commit, load_resharded, plan, reshard_in_memory,
                                write_shard)
from zeroray.checkpoint.reshard import apply_plan

# Odd unit sizes on purpose: 1, 7, 13, 5, 2, 31 elements; none divides evenly by most world sizes.
UNITS = [
    ("a", [("a.w", (1,))]),
    ("b", [("b.w", (7,))]),
    ("c", [("c.w", (3, 4)), ("c.b", (1,))]),
    ("d", [("d.w", (5,))]),
    ("e", [("e.w", (2,))]),
    ("f", [("f.w", (31,))]),
]


def layout(world_size, units=UNITS):
    return FlatLayout(units, world_size)


def shard_of(lay: FlatLayout, logical: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local shard of ``logical`` (unpadded units end to end), padding zero."""
    shard = torch.zeros(lay.shard_numel, dtype=logical.dtype)
    for unit, start in zip(lay.units, lay.logical_offsets()):
        lo, hi = unit.rank_range(rank)
        shard[unit.shard_offset:unit.shard_offset + hi - lo] = logical[start + lo:start + hi]
    return shard


PAIRS = list(itertools.product(range(1, 7), range(1, 7))) + [(3, 17), (16, 5), (1, 64), (40, 1)]


@pytest.mark.parametrize("n,m", PAIRS)
def test_plan_assembles_the_new_shards(n, m):
    old, new = layout(n), layout(m)
    logical = torch.randn(old.numel)
    old_shards = [shard_of(old, logical, r) for r in range(n)]
    for rank in range(m):
        copies = plan(old, new, rank)
        out = apply_plan(copies, old_shards, torch.zeros(new.shard_numel))
        assert torch.equal(out, shard_of(new, logical, rank))
        # Copies are disjoint and never touch padding, so their total is the owned elements.
        owned = sum(hi - lo for u in new.units for lo, hi in [u.rank_range(rank)])
        assert sum(c.numel for c in copies) == owned


def test_same_world_size_merges_into_few_copies():
    units = [("x", [("x.w", (8,))]), ("y", [("y.w", (4,))])]  # no padding at world size 4
    old = new = layout(4, units)
    for rank in range(4):
        assert plan(old, new, rank) == [plan(old, new, rank)[0]]  # one contiguous copy
        c = plan(old, new, rank)[0]
        assert (c.src_rank, c.src_start, c.dst_start, c.numel) == (rank, 0, 0, new.shard_numel)


def test_reshard_in_memory_all_keys():
    old, new = layout(3), layout(5)
    logical = {k: torch.randn(old.numel) for k in ("master", "optim.exp_avg", "optim.exp_avg_sq")}
    states = []
    for r in range(3):
        s = {k: shard_of(old, v, r) for k, v in logical.items()}
        s["scalars"] = {"step": 7, "rng": [r, 1, 2]}
        s["optim.step"] = torch.tensor(7.0)  # not sharded: a per-rank tensor
        states.append(s)
    for rank in range(5):
        got = reshard_in_memory(old, states, new, rank)
        for k, v in logical.items():
            assert torch.equal(got[k], shard_of(new, v, rank)), k
        assert got["scalars"] == {"step": 7, "rng": [min(rank, 2), 1, 2]}
        assert torch.equal(got["optim.step"], torch.tensor(7.0))
    got["scalars"]["rng"].append(9)  # a deep copy: the source state is untouched
    assert states[2]["scalars"]["rng"] == [2, 1, 2]


def test_mismatched_models_are_named():
    other = [("a", [("a.w", (1,))]), ("b", [("b.w", (8,))]), ("c", [("c.w", (3, 4)), ("c.b", (1,))]),
             ("d", [("d.w", (5,))]), ("e", [("e.w", (2,))]), ("g", [("g.w", (3,))])]
    with pytest.raises(ValueError) as info:
        plan(layout(2), layout(3, other), 0)
    msg = str(info.value)
    assert "missing from the checkpoint: [g.w]" in msg
    assert "unexpected in the checkpoint (not in the model): [f.w]" in msg
    assert "b.w: checkpoint [7] vs model [8]" in msg


def test_same_params_in_other_units_is_an_error():
    regrouped = [("ab", [("a.w", (1,)), ("b.w", (7,))])] + UNITS[2:]
    with pytest.raises(ValueError, match="grouped into different units"):
        plan(layout(2), layout(2, regrouped), 0)


def test_new_rank_out_of_range():
    with pytest.raises(ValueError, match="outside the new world size 3"):
        plan(layout(2), layout(3), 3)


def save(root, lay, step, logical, scalars=None):
    infos = []
    for r in range(lay.world_size):
        tensors = {k: shard_of(lay, v, r) for k, v in logical.items()}
        infos.append(write_shard(root, step, r, tensors, scalars or {"step": step, "rank": r}))
    return commit(root, step, {"layout": lay}, infos)


@pytest.mark.parametrize("n,m", [(1, 3), (4, 2), (3, 5), (2, 2), (5, 1)])
def test_save_at_n_load_at_m(tmp_path, n, m):
    old, new = layout(n), layout(m)
    logical = {"master": torch.randn(old.numel), "optim.momentum_buffer": torch.randn(old.numel)}
    save(tmp_path, old, 3, logical)
    for rank in range(m):
        tensors, scalars = load_resharded(tmp_path, new, rank)
        assert set(tensors) == set(logical)
        for k, v in logical.items():
            assert torch.equal(tensors[k], shard_of(new, v, rank))
        assert scalars == {"step": 3, "rank": min(rank, n - 1)}


def test_load_reads_only_the_files_it_needs(tmp_path):
    lay = layout(4)
    logical = {"master": torch.randn(lay.numel)}
    step_dir = save(tmp_path, lay, 1, logical)
    os.remove(os.path.join(step_dir, "shard_00003.safetensors"))
    tensors, _ = load_resharded(tmp_path, lay, 0)  # rank 0 needs only old rank 0
    assert torch.equal(tensors["master"], shard_of(lay, logical["master"], 0))
    with pytest.raises(CheckpointError, match="shard_00003.safetensors is missing"):
        load_resharded(tmp_path, lay, 3)


def test_loading_into_another_model_names_the_differences(tmp_path):
    save(tmp_path, layout(2), 1, {"master": torch.randn(layout(2).numel)})
    smaller = layout(2, UNITS[:-1])
    with pytest.raises(CheckpointError, match=r"unexpected in the checkpoint \(not in the model\): \[f.w\]") as info:
        load_resharded(tmp_path, smaller, 0)
    assert str(tmp_path) in str(info.value)


def test_long_name_lists_are_shortened():
    many = [(f"m{i}", [(f"m{i}.w", (2,))]) for i in range(30)]
    with pytest.raises(ValueError, match=r"\[m0.w, .*m19.w, ... and 10 more\]"):
        plan(layout(1, many), layout(1, UNITS), 0)
