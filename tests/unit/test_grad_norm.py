"""The gradient norm a rank contributes to clipping (zeroray/engine/optim.py, ``squared_norm``) is
exact to fp32 rounding however long its shard, where one fp32 ``vector_norm`` over the shard lost
digits with its length (1e-3 relative on 13M elements, on one CPU thread: the worker's setting)."""
import pytest
import torch

from zeroray.engine.optim import ROW, squared_norm


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("numel", [1, ROW - 1, ROW, 5 * ROW + 7, 13_000_003])
def test_squared_norm_is_exact_to_fp32_rounding(one_thread, numel):
    g = torch.Generator().manual_seed(numel)
    flat = torch.randn(numel, generator=g) * 1e-3
    flat[: max(1, numel // 1000)] *= 1000  # a few large gradients among many small ones
    want = flat.double().square().sum().item()
    got = squared_norm(flat)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(got.item() - want) <= 1e-6 * want
    if numel > 10_000_000:  # what the one long fp32 reduction gave: the test tells them apart
        assert abs(torch.linalg.vector_norm(flat).double().square().item() - want) > 1e-4 * want


def test_empty_and_zero():
    assert squared_norm(torch.zeros(0)).item() == 0.0
    assert squared_norm(torch.zeros(3 * ROW)).item() == 0.0
