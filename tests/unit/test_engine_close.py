"""Closing an engine returns its memory (issue 14 item 3), in one process, on CPU.

On an H200 every closed 808M-parameter engine left its whole model state behind: hooks
registered on tensors are held from C++ (autograd), so a cycle through them survives
``gc.collect()``. Here the engine must be collectable after ``close()`` (a weak reference
dies) and every tensor byte it allocated must be gone (a gc census of live storages), for
every stage, with activation checkpointing (which wraps module forwards) and mixed precision.
"""
import functools
import gc
import weakref

import pytest
import torch

import zeroray as zr
from examples import gpt
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.memory.report import live_tensor_bytes

CFG = gpt.GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=16)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_closed_engine_is_collected_with_all_its_tensors(stage):
    batches = list(gpt.CharBatches(4, CFG.seq_len, 2, seed=3))
    gc.collect()
    before = live_tensor_bytes(floating_only=False)
    engine = Engine(functools.partial(gpt.GPT, CFG), gpt.gpt_loss, zr.AdamW(lr=1e-3),
                    zr.ZeroConfig(stage=stage, dtype="bf16", activation_checkpointing=True), SoloGroup())
    for batch in batches:
        engine.train_step(batch)
    during = live_tensor_bytes(floating_only=False)
    ref = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    after = live_tensor_bytes(floating_only=False)
    assert during - before > 4 * 100_000  # the engine held its model state (>100k params)
    assert ref() is None, "a closed engine must be collectable: something still refers to it"
    assert after == before, (before, during, after)
