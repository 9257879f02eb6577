"""The flat layout: unit offsets, padding, shard ranges for sizes that do not divide, tied weights."""
import pytest
import torch
import torch.nn as nn

from zeroray.layout.arena import FlatLayout
from tests.models import DIM, VOCAB, parity_model


def test_units_follow_modules_and_pad_to_the_world_size():
    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    layout = FlatLayout.from_module(model, 4)
    assert [u.module for u in layout.units] == ["0", "1", "2"]
    assert [u.numel for u in layout.units] == [20, 10, 18]
    assert [u.padded for u in layout.units] == [20, 12, 20]
    assert [u.shard_numel for u in layout.units] == [5, 3, 5]
    assert [u.shard_offset for u in layout.units] == [0, 5, 8]
    assert [u.full_offset for u in layout.units] == [0, 20, 32]
    assert layout.shard_numel == 13 and layout.full_numel == 52 and layout.numel == 48
    slot = layout.slots["0.bias"]
    assert (slot.unit, slot.offset, slot.numel, slot.shape) == (0, 15, 5, (5,))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_rank_ranges_cover_every_element_once(world):
    layout = FlatLayout.from_module(parity_model(), world)
    for unit in layout.units:
        covered = []
        for rank in range(world):
            lo, hi = unit.rank_range(rank)
            assert 0 <= lo <= hi <= unit.numel and hi - lo <= unit.shard_numel
            covered += list(range(lo, hi))
        assert covered == list(range(unit.numel))


@pytest.mark.parametrize("world", [2, 3])
def test_param_shard_views_reassemble_each_parameter(world):
    model = parity_model()
    layout = FlatLayout.from_module(model, world)
    params = dict(model.named_parameters())
    shards = []
    for rank in range(world):
        shard = torch.zeros(layout.shard_numel)
        for name in layout.param_names:
            piece, lo, hi = layout.param_shard_view(shard, name, rank)
            piece.copy_(params[name].detach().reshape(-1)[lo:hi])
        shards.append(shard)
    for name in layout.param_names:
        flat = torch.zeros(layout.slots[name].numel)
        for rank in range(world):
            piece, lo, hi = layout.param_shard_view(shards[rank], name, rank)
            flat[lo:hi] = piece
        assert torch.equal(flat, params[name].detach().reshape(-1)), name


def test_tied_weights_stored_once_frozen_and_buffers_left_out():
    layout = FlatLayout.from_module(parity_model(), 2)
    assert "emb.weight" in layout.param_names and "head.weight" not in layout.param_names
    assert layout.slots["head.weight"] is layout.slots["emb.weight"]
    assert layout.aliases() == {"emb.weight": ["head.weight"]}
    assert "frozen.weight" not in layout.slots and "frozen.bias" in layout.slots
    assert "scale" not in layout.slots
    # The output layer uses the embedding's unit.
    assert layout.module_units["head"] == layout.module_units["emb"]
    trainable = sum(p.numel() for p in parity_model().parameters() if p.requires_grad)
    assert layout.numel == trainable == VOCAB * DIM + 2 * (DIM * DIM + DIM) - DIM * DIM + 2 * DIM


def test_layout_round_trips_and_changes_world_size():
    layout = FlatLayout.from_module(parity_model(), 3)
    again = FlatLayout.from_dict(layout.to_dict())
    assert again.unit_specs() == layout.unit_specs() and again.world_size == 3
    four = layout.with_world_size(4)
    assert four.same_params_as(layout) and four.full_numel % 4 == 0
    assert [u.padded % 4 for u in four.units] == [0] * len(four.units)
