"""Buffers and frozen parameters through the Trainer's state under mixed precision (issue 24):
``state_dict()`` hands them back in the model's own dtypes (it loads strict into the fp32
model), and a restored or resized Trainer holds the BatchNorm running statistics it saved, not
the model's initial ones."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroray as zr


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.frozen = nn.Parameter(torch.full((8,), 0.1), requires_grad=False)

    def forward(self, x):
        h = self.fc(x.to(self.fc.weight.dtype)) * self.scale + self.frozen
        return self.out(torch.relu(self.bn(h)))


def bn_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def batches(n):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


UNTRAINED = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "scale", "frozen")


def test_buffers_survive_save_restore_and_resize_in_their_dtypes(ray_local, tmp_path):
    root = str(tmp_path / "ckpt")
    kwargs = dict(optimizer=zr.AdamW(lr=1e-2), zero=zr.ZeroConfig(stage=3, dtype="bf16"))
    initial = BNNet().state_dict()
    with zr.Trainer(BNNet, bn_loss, scaling=zr.ScalingConfig(num_workers=2), **kwargs) as trainer:
        for b in batches(2):
            trainer.step(b)
        saved = trainer.state_dict()
        user = BNNet()
        user.load_state_dict(saved, strict=True)
        assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in initial.items()}
        assert int(saved["bn.num_batches_tracked"]) == 2
        assert not torch.equal(saved["bn.running_mean"], initial["bn.running_mean"])
        trainer.save(root)
        trainer.resize(1)
        resized = trainer.state_dict()
    with zr.Trainer.restore(root, BNNet, bn_loss, scaling=zr.ScalingConfig(num_workers=2), **kwargs) as restored:
        back = restored.state_dict()
    for name in UNTRAINED:
        assert resized[name].dtype == back[name].dtype == saved[name].dtype, name
        # exact: the fp32 statistics went through bf16 nowhere, and scale/frozen are bf16-exact
        assert torch.equal(resized[name], saved[name]), f"resize lost {name}"
        assert torch.equal(back[name], saved[name]), f"restore lost {name}"
