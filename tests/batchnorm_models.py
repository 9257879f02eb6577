"""BatchNorm models for the SyncBatchNorm and buffer tests, and an obviously correct sync for DDP.

The layers feeding a BatchNorm have no bias, as in ResNets: BatchNorm removes each channel's
mean, so such a bias has an exact gradient of zero, and AdamW would turn its rounding noise
into steps of the learning rate's size.
"""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES, CLASSES, ROWS = 6, 5, 12  # ROWS: the global batch, divisible by 2 and 3 workers


class ConvBN(nn.Module):
    """Two conv-BatchNorm2d blocks and a linear head: what vision users convert under DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.head.weight.dtype)  # the input in the compute dtype, as for model.to(dtype)
        return self.head(self.features(x).mean((2, 3)))


class MLPBN(nn.Module):
    """BatchNorm1d twice: a cumulative average (momentum=None), and one without affine parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, 16, bias=False)
        self.bn = nn.BatchNorm1d(16, momentum=None)
        self.fc2 = nn.Linear(16, 16, bias=False)
        self.bn2 = nn.BatchNorm1d(16, affine=False)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.head.weight.dtype)
        return self.head(F.relu(self.bn2(self.fc2(F.relu(self.bn(self.fc(x)))))))


def conv_bn() -> nn.Module:
    return ConvBN()


def mlp_bn() -> nn.Module:
    return MLPBN()


def sync_conv_bn() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(ConvBN())


def sync_mlp_bn() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(MLPBN())


def class_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def image_batches(steps: int, seed: int = 0, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    # channels with their own offsets and scales: normalising over other rows moves them
    shift = torch.tensor([2.0, -1.0, 0.5]).view(1, 3, 1, 1)
    return [(torch.randn(rows, 3, 6, 6, generator=g) * 1.5 + shift, torch.randint(0, CLASSES, (rows,), generator=g))
            for _ in range(steps)]


def feature_batches(steps: int, seed: int = 0, rows: int = ROWS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, FEATURES, generator=g) * 2 + 1, torch.randint(0, CLASSES, (rows,), generator=g))
            for _ in range(steps)]


class GatherBatchNorm(nn.Module):
    """The DDP reference's synchronised BatchNorm, written to be obviously right: gather every
    rank's rows (``torch.distributed.nn.functional.all_gather`` carries the gradient back to
    each rank's own rows), run ``F.batch_norm`` on all of them with this module's running
    statistics, keep this rank's rows. Holds the parameters and buffers of the BatchNorm it
    replaces, under the same names."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.momentum, self.eps = bn.momentum, bn.eps
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_gather

        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of functional collectives
            # the group named: all_gather's default is the WORLD of when torch imported it, stale
            # in a process that ran under another default group before (the harness's runs)
            rows = all_gather(x, group=dist.group.WORLD)
        out = F.batch_norm(torch.cat(rows), self.running_mean, self.running_var, self.weight, self.bias, True,
                           factor, self.eps)
        start = sum(r.shape[0] for r in rows[:dist.get_rank()])
        return out[start:start + x.shape[0]]


def with_gather_batchnorm(model: nn.Module) -> nn.Module:
    """``model`` with each BatchNorm replaced by a GatherBatchNorm holding its tensors."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, GatherBatchNorm(child))
        else:
            with_gather_batchnorm(child)
    return model
