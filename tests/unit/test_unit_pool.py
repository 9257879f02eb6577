"""Stage 3's unit pool on CPU ([Note: unit pool] in zeroray/memory/unit_pool.py): its memory moves
in and out of a unit's storage under every view of it, and a freed unit's mapping serves the next
gather of that size."""
import torch
import torch.nn as nn

import zeroray as zr
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.memory.report import measure
from zeroray.memory.unit_pool import UnitPool


def _freed(numel: int) -> torch.Tensor:
    full = torch.empty(numel)
    full.untyped_storage().resize_(0)
    return full


def test_views_read_the_pool_memory_and_a_freed_mapping_is_reused():
    pool = UnitPool()
    full = torch.empty(1000)
    weight = full[10:30].view(4, 5)  # a parameter's view (Units.bind cuts them from allocated storage)
    saved = weight.t()               # and a view of it, as autograd saves for a linear layer
    full.untyped_storage().resize_(0)
    pool.fill(full.untyped_storage(), 4000)
    full.copy_(torch.arange(1000, dtype=torch.float32))
    assert torch.equal(saved, torch.arange(10, 30, dtype=torch.float32).view(4, 5).t())
    first = full.untyped_storage().data_ptr()
    assert pool.mapped_bytes == 4000 and pool.idle_bytes == 0

    pool.take_back(full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and pool.idle_bytes == 4000

    other = _freed(1000)  # another unit of the same size takes the same mapping: nothing new mapped
    pool.fill(other.untyped_storage(), 4000)
    assert other.untyped_storage().data_ptr() == first and pool.mapped_bytes == 4000 and pool.idle_bytes == 0

    pool.fill(full.untyped_storage(), 4000)  # none idle: a mapping of its own
    assert full.untyped_storage().data_ptr() != first and pool.mapped_bytes == 8000
    full.fill_(7.0)
    assert torch.equal(saved, torch.full((5, 4), 7.0)) and float(other.sum()) == sum(range(1000))


def test_the_pool_never_holds_more_than_its_peak_in_use():
    """Units that all differ in size reuse nothing: the oldest idle mappings go back to the OS."""
    pool = UnitPool()
    a, b, c = _freed(256), _freed(512), _freed(384)
    pool.fill(a.untyped_storage(), 1024)
    pool.fill(b.untyped_storage(), 2048)
    assert pool.peak_bytes == 3072
    pool.take_back(a.untyped_storage())
    pool.take_back(a.untyped_storage())  # already freed: nothing to take
    pool.take_back(b.untyped_storage())
    assert pool.idle_bytes == 3072 and pool.in_use_bytes == 0  # within the peak: both kept
    # No idle mapping of c's size: a new one, and idle ones go back, oldest first, until the pool is
    # within its peak again (a's alone is not enough).
    pool.fill(c.untyped_storage(), 1536)
    assert pool.mappings_made == 3 and pool.in_use_bytes == 1536 and pool.idle_bytes == 0
    pool.fill(a.untyped_storage(), 1024)  # a's mapping went back: a new one
    assert pool.mappings_made == 4 and pool.mapped_bytes == 2560 <= pool.peak_bytes
    c.fill_(1.0)
    assert float(c.sum()) == 384.0
    pool.take_back(c.untyped_storage())
    pool.release()
    assert pool.idle_bytes == 0 and pool.mapped_bytes == pool.in_use_bytes == 1024


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32),
                         nn.LayerNorm(32), nn.Linear(32, 64))


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))


def test_stage3_on_cpu_stops_mapping_after_its_second_step_and_trains_as_single_process_torch():
    torch.manual_seed(0)
    batches = [(torch.randint(0, 64, (4, 9)), torch.randint(0, 64, (4, 9))) for _ in range(4)]
    engine = Engine(_model, _loss, zr.AdamW(lr=1e-2), zr.ZeroConfig(stage=3), SoloGroup(), seed=0)
    torch.manual_seed(0)
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    pool = engine.units.pool
    made = []
    for batch in batches:
        optimizer.zero_grad()
        expected = _loss(reference, batch)
        expected.backward()
        optimizer.step()
        assert abs(engine.train_step(batch).loss - expected.item()) < 1e-5
        made.append(pool.mappings_made)
        # Between steps every unit is freed, and the pool holds no more than the most in use at once.
        assert pool.in_use_bytes == 0 and 0 < pool.idle_bytes <= pool.peak_bytes
    # The first step records the trace (no prefetch); from the second on the same mappings serve.
    assert made[2:] == made[1:2] * 2, made
    assert measure(engine)["unit_pool_idle"] == pool.idle_bytes  # memory_report names what it keeps
