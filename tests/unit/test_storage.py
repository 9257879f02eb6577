"""The engine's storage objects (engine/storage.py) on a small real model laid out for two ranks:
stage 0's replicated storage and the sharded storage of stages 1-3 report the same shard
coordinates, their state conversions round-trip, and publishing casts the master back.

No collective runs here: each rank's storage is built in this process with a group that only
names the rank (its gatherer is never used)."""
import pytest
import torch

from zeroray.comm.group import CommCounter, Group
from zeroray.engine.storage import ReplicatedStorage, ShardedStorage, build_storage
from zeroray.layout.arena import FlatLayout
from zeroray.layout.stage import StagePolicy

WORLD = 2


class RankOf(Group):
    """Rank ``rank`` of ``WORLD``: the storage reads the rank; nothing here calls a collective."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.counter = rank, WORLD, CommCounter()


class PublishGathers:
    """Where the storage starts the gathers that publish an update (stages 1-2: the engine's
    UpdatePublisher, fetch/publish.py); here it only counts them: nothing is gathered."""

    def __init__(self) -> None:
        self.started = 0

    def publish(self) -> None:
        self.started += 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: uneven slices and padding in every unit
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _storage(stage: int, rank: int, dtype=torch.float32):
    model = _model().to(dtype)  # as the engine casts it (engine/precision.py) before building the storage
    layout = FlatLayout.from_module(model, WORLD, "module")
    named = dict(model.named_parameters())
    whole = {n: p.detach().clone() for n, p in named.items()}
    storage = build_storage(StagePolicy.for_stage(stage), layout, named, None, RankOf(rank), dtype=dtype,
                            device=torch.device("cpu"), bucket_bytes=1 << 20, wait=lambda handle: handle.wait())
    return storage, layout, whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_stage_gives_the_same_shard_coordinates(dtype):
    for rank in range(WORLD):
        replicated = _storage(0, rank, dtype)[0]
        assert isinstance(replicated, ReplicatedStorage) and replicated.param_shard is None
        expected = replicated.master_shard()
        for stage in (1, 2, 3):
            sharded = _storage(stage, rank, dtype)[0]
            assert isinstance(sharded, ShardedStorage) and sharded.gatherer is not None
            assert sharded.state_layout() == (sharded.layout, rank)
            assert torch.equal(sharded.master_shard(), expected), (stage, rank)
            moments = {"exp_avg": torch.arange(sharded.grad.numel(), dtype=torch.float32)}
            assert sharded.exported(moments) is moments and sharded.imported(moments) is moments
        # the optimizer's full-size tensors of stage 0 leave in the same coordinates as its master
        full = replicated.master.as_tensor()
        assert torch.equal(replicated.exported({"exp_avg": full})["exp_avg"], expected)


def test_master_pieces_cover_each_parameter_once():
    _, layout, whole = _storage(0, 0)
    for stage in (0, 1, 3):
        for name, value in whole.items():
            flat = torch.full((value.numel(),), float("nan"))
            for rank in range(WORLD):
                storage = _storage(stage, rank)[0]
                lo, hi, piece = storage.master_piece(name)
                assert torch.isnan(flat[lo:hi]).all()  # no element reported twice
                flat[lo:hi] = piece
                start, end = storage.param_spans().get(name, (0, 0))
                # the optimizer's spans: stage 0 steps every parameter whole on every rank
                assert end - start == (value.numel() if stage == 0 else hi - lo)
            assert torch.equal(flat, value.reshape(-1)), (stage, name)


def test_stage_0_state_round_trips_through_one_rank_coordinates():
    """Export cuts each rank's shard out of the full master; import takes the checkpoint in the
    coordinates of a one-rank layout (state_layout) and lays it out in full coordinates again."""
    storages = [_storage(0, rank)[0] for rank in range(WORLD)]
    layout = storages[0].layout
    single, rank0 = storages[0].state_layout()
    assert rank0 == 0 and single.world_size == 1
    one = torch.zeros(single.shard_numel)
    for rank, storage in enumerate(storages):
        shard = storage.exported({"master": storage.master.as_tensor()})["master"]
        for unit, flat in zip(layout.units, single.units):
            lo, hi = unit.rank_range(rank)
            one[flat.shard_offset + lo:flat.shard_offset + hi] = shard[unit.shard_offset:unit.shard_offset + hi - lo]
    full = storages[1].imported({"master": one})["master"]
    assert torch.equal(full, storages[1].master.as_tensor())
    assert storages[0].counts_norm and not storages[1].counts_norm


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_publish_casts_the_updated_master_into_the_parameters(stage):
    storage, layout, _ = _storage(stage, 1, torch.bfloat16)
    assert storage.master.dtype == torch.float32 and storage.cast
    storage.master.copy_(torch.linspace(-1, 1, storage.master.numel()))
    gathers = PublishGathers()
    storage.publish(gathers)
    assert gathers.started == (1 if stage == 1 else 0)  # stages 1-2 start the gathers here; 0 and 3 do not
    compute = storage.param_shard if stage else storage.units.arena
    expected = storage.master.clone().to(torch.bfloat16)
    assert compute.dtype == torch.bfloat16
    assert torch.equal(compute.clone() if stage else compute, expected)


def test_fp32_masters_are_the_parameters_themselves():
    replicated = _storage(0, 0)[0]
    assert replicated.master.as_tensor().data_ptr() == replicated.units.arena.data_ptr() and not replicated.cast
    rows = _storage(1, 1)[0]
    assert rows.master is rows.param_shard and not rows.cast
    assert rows.master.tensors()[0].untyped_storage().data_ptr() == rows.units.arena.untyped_storage().data_ptr()
    own = _storage(3, 1)[0]
    assert own.master is own.param_shard and own.units.arena is None
