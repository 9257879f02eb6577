"""Activation checkpointing (ZeRO-R P_a): same losses and gradients as without it, fewer
activation bytes kept. In-process engines over a SoloGroup (world size 1)."""
import functools

import pytest
import torch

import zeroray as zr
from examples import gpt
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine

CFG = gpt.GPTConfig(d_model=64, n_layers=3, n_heads=4, seq_len=32)
BATCHES = list(gpt.CharBatches(4, CFG.seq_len, 2, seed=3))
CHECKPOINTING = {
    "blocks": dict(activation_checkpointing=(gpt.Block,)),
    "all": dict(activation_checkpointing=True),
    "offload": dict(activation_checkpointing=(gpt.Block,), offload_activations=True),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: on a shared, loaded machine a second intra-op thread only adds spin-waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(stage, **zero):
    engine = Engine(functools.partial(gpt.GPT, CFG), gpt.gpt_loss, zr.AdamW(lr=1e-3),
                    zr.ZeroConfig(stage=stage, **zero), SoloGroup(), seed=0)
    out = {"losses": [], "grads": [], "norms": []}
    for batch in BATCHES:
        stats = engine.train_step(batch)
        out["losses"].append(stats.loss)
        out["norms"].append(stats.grad_norm)
        out["grads"].append(engine.grad.clone())  # this step's averaged fp32 gradient
    out["master"] = engine.master_shard()
    out["activations"] = engine.activation_peak_bytes
    engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointing_is_numerically_equal_and_keeps_fewer_bytes(stage):
    plain = train(stage)
    assert plain["activations"] > 0
    for name, zero in CHECKPOINTING.items():
        got = train(stage, **zero)
        where = f"stage {stage}, {name}"
        assert got["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0), where
        assert got["norms"] == pytest.approx(plain["norms"], rel=1e-5), where
        for a, b in zip(got["grads"], plain["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(got["master"], plain["master"], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{where}: {m}")
        # Only the blocks' inputs are kept: at most half of what the whole forward saves here.
        assert got["activations"] < 0.5 * plain["activations"], (where, got["activations"], plain["activations"])


def test_checkpoint_targets():
    from zeroray.engine.activations import checkpoint_targets

    model = gpt.GPT(CFG)
    by_type = [name for name, _ in checkpoint_targets(model, (gpt.Block,))]
    every_block = [name for name, _ in checkpoint_targets(model, True)]
    assert by_type == every_block == [f"blocks.{i}" for i in range(CFG.n_layers)]
    assert checkpoint_targets(model, False) == []
