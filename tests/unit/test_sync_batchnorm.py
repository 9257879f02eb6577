"""SyncBatchNorm's CPU forward in one process ([Note: SyncBatchNorm on CPU] in
zeroray/engine/sync_batchnorm.py): which modules it takes, that it puts them back, that it falls
back to plain BatchNorm where torch's would, and its autograd function's math against
``F.batch_norm`` over a group of one (the synchronised math with W ranks is
tests/dist/test_sync_batchnorm.py). And the engine never initialises torch.distributed itself (a
spare's throwaway build must not: [Note: torch.distributed in user code])."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroray as zr
from tests.batchnorm_models import class_loss, image_batches, sync_conv_bn
from zeroray.comm.group import SoloGroup
from zeroray.comm.user_group import join_default_group, leave_default_group
from zeroray.engine import sync_batchnorm
from zeroray.engine.engine import Engine


class OwnForward(nn.SyncBatchNorm):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.fixture
def group_of_one():
    join_default_group(SoloGroup(), "gloo", 30)
    try:
        yield dist.group.WORLD
    finally:
        leave_default_group()


def test_install_takes_torch_s_sync_batchnorm_only_and_puts_it_back():
    model = nn.Sequential(nn.SyncBatchNorm(3), OwnForward(3), nn.BatchNorm1d(3))
    restore = sync_batchnorm.install(model, torch.device("cpu"))
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__ and "forward" not in model[2].__dict__
    restore()
    assert all("forward" not in m.__dict__ for m in model)
    sync_batchnorm.install(model, torch.device("cuda"))  # GPU workers: torch's own
    assert all("forward" not in m.__dict__ for m in model)


@pytest.mark.parametrize("with_group", [False, True])
def test_without_a_group_to_sync_over_it_is_plain_batchnorm(with_group, request):
    """torch.distributed not initialised, or a group of one: F.batch_norm, bit for bit, as torch's."""
    if with_group:
        request.getfixturevalue("group_of_one")
    torch.manual_seed(0)
    ours, plain = nn.SyncBatchNorm(4, momentum=None), nn.BatchNorm2d(4, momentum=None)
    sync_batchnorm.install(ours, torch.device("cpu"))
    x = torch.randn(6, 4, 3, 3) * 3 + 1
    for train in (True, True, False):
        ours.train(train), plain.train(train)
        assert torch.equal(ours(x), plain(x))
    assert torch.equal(ours.running_var, plain.running_var) and int(ours.num_batches_tracked) == 2


@pytest.mark.parametrize("shape,momentum,affine", [((6, 4, 3, 3), 0.1, True), ((5, 4), None, True),
                                                   ((5, 4, 7), 0.3, False)])
def test_the_function_is_batch_norm_forward_and_backward(group_of_one, shape, momentum, affine):
    torch.manual_seed(1)
    x = (torch.randn(*shape) * 2 + 0.5).requires_grad_()
    w = (torch.rand(4) + 0.5).requires_grad_() if affine else None
    b = torch.randn(4).requires_grad_() if affine else None
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    factor = 0.25 if momentum is None else momentum
    grad = torch.randn(*shape)
    ours_mean, ours_var = mean.clone(), var.clone()
    out = sync_batchnorm.SyncBatchNormCPU.apply(x, w, b, ours_mean, ours_var, 1e-5, factor, group_of_one)
    got = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], grad)
    ref_mean, ref_var = mean.clone(), var.clone()
    ref = F.batch_norm(x, ref_mean, ref_var, w, b, True, factor, 1e-5)
    want = torch.autograd.grad(ref, [t for t in (x, w, b) if t is not None], grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_mean, ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_var, ref_var, rtol=1e-6, atol=1e-6)  # unbiased over the count


def test_the_engine_never_initialises_torch_distributed():
    """A SyncBatchNorm model built and stepped by an engine alone (what a spare's warm-up does)
    leaves torch.distributed as it found it: uninitialised, the modules plain BatchNorm."""
    assert not dist.is_initialized()
    engine = Engine(sync_conv_bn, class_loss, zr.AdamW(lr=1e-2), zr.ZeroConfig(stage=3), SoloGroup())
    engine.train_step(image_batches(1)[0])
    engine.evaluate(image_batches(1)[0])
    engine.close()
    assert not dist.is_initialized()
