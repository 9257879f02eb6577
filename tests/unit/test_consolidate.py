"""Consolidation: full parameters from shards equal the model's, with tied aliases, frozen
parameters and buffers, so the result loads with strict=True; and the CLI entry points."""
import io
import os

import pytest
import safetensors.torch
import torch
from torch import nn

from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint import (cli_consolidate, cli_inspect, commit, consolidate, iter_full_params,
                                write_extra, write_shard)


class Tiny(nn.Module):
    """Tied embedding/head, odd sizes, a frozen parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.mid = nn.Linear(5, 3)
        self.norm = nn.LayerNorm(3)
        self.up = nn.Linear(3, 5, bias=False)
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.randn(7), requires_grad=False)
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.int64))


def model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def save_model(root, m, world_size, step=5, with_extra=True):
    lay = FlatLayout.from_module(m, world_size)
    params = dict(m.named_parameters())
    infos = []
    for rank in range(world_size):
        master = torch.zeros(lay.shard_numel)
        for name in lay.param_names:
            view, lo, hi = lay.param_shard_view(master, name, rank)
            view.copy_(params[name].detach().reshape(-1)[lo:hi])
        infos.append(write_shard(root, step, rank, {"master": master, "optim.exp_avg": master * 0.5},
                                 {"step": step}))
    if with_extra:
        trainable = {n for n, p in m.named_parameters() if p.requires_grad}
        sd = m.state_dict()
        tied = set(lay.slots)  # canonical names and aliases of trainable parameters
        infos.append(write_extra(root, step, {k: v for k, v in sd.items()
                                              if k not in tied and k not in trainable}))
    commit(root, step, {"layout": lay, "config": {"model": "Tiny"}}, infos)
    return lay


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_consolidated_file_loads_strictly(tmp_path, world_size):
    m = model()
    save_model(tmp_path / "ckpt", m, world_size)
    out = tmp_path / "full.safetensors"
    consolidate(tmp_path / "ckpt", out)
    loaded = safetensors.torch.load_file(str(out))
    expected = m.state_dict()
    assert set(loaded) == set(expected)  # includes "head.weight" (tied), "scale", "steps"
    for k, v in expected.items():
        assert loaded[k].dtype == (torch.float32 if v.is_floating_point() else v.dtype)
        assert torch.equal(loaded[k], v), k
    fresh = model(seed=1)
    fresh.load_state_dict(loaded, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert fresh.head.weight is fresh.emb.weight  # loading keeps the tie


def test_iter_full_params_yields_each_parameter_once(tmp_path):
    m = model()
    lay = save_model(tmp_path, m, 3)
    got = list(iter_full_params(tmp_path))
    assert [n for n, _ in got] == lay.param_names
    assert "head.weight" not in dict(got)
    params = dict(m.named_parameters())
    for name, tensor in got:
        assert tensor.shape == params[name].shape and torch.equal(tensor, params[name].detach())
    aliased = dict(iter_full_params(tmp_path, with_aliases=True))
    assert torch.equal(aliased["head.weight"], params["emb.weight"].detach())


def test_without_extra_file_loads_non_strict(tmp_path):
    m = model()
    save_model(tmp_path / "ckpt", m, 2, with_extra=False)
    out = tmp_path / "sub" / "full.safetensors"  # parent directory is created
    consolidate(tmp_path / "ckpt", out)
    result = model(seed=1).load_state_dict(safetensors.torch.load_file(str(out)), strict=False)
    assert sorted(result.missing_keys) == ["scale", "steps"] and result.unexpected_keys == []


def test_consolidate_through_file_uris(tmp_path):
    m = model()
    save_model(f"file://{tmp_path}/ckpt", m, 3)
    consolidate(f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out.safetensors")
    model(seed=1).load_state_dict(safetensors.torch.load_file(str(tmp_path / "out.safetensors")))


def test_cli_inspect_and_consolidate(tmp_path, capsys):
    m = model()
    lay = save_model(tmp_path / "ckpt", m, 3)
    out = io.StringIO()
    assert cli_inspect(tmp_path / "ckpt", out=out) == 0
    text = out.getvalue()
    assert "step: 5" in text and "world size: 3" in text and '"model": "Tiny"' in text
    assert f"parameters: {lay.numel:,} trainable" in text and "shard_00002.safetensors" in text
    assert "extra.safetensors" in text

    assert cli_consolidate(tmp_path / "ckpt", tmp_path / "m.safetensors", out=io.StringIO()) == 0
    model(seed=1).load_state_dict(safetensors.torch.load_file(str(tmp_path / "m.safetensors")))

    os.remove(tmp_path / "ckpt" / "step_00000005" / "shard_00001.safetensors")
    out = io.StringIO()
    assert cli_inspect(tmp_path / "ckpt", out=out) == 1
    assert "MISSING" in out.getvalue()
    assert cli_consolidate(tmp_path / "ckpt", tmp_path / "m2.safetensors", out=io.StringIO()) == 1
    assert "shard_00001.safetensors is missing" in capsys.readouterr().err
    assert not (tmp_path / "m2.safetensors").exists()
    assert cli_inspect(tmp_path / "nothing", out=io.StringIO()) == 1
