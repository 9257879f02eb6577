"""``ZeroConfig(stage="auto")`` against what then runs: the stage is chosen for the user's first batch,
accumulation and offload within a memory budget, and the run at that stage stays within it, while the
stage the plan rejected goes over it.

On CPU workers the budget counts training's tensors, what ``Trainer.memory_report()`` measures of
them on each worker: the model states, the stage-3 gathered window, the bucket buffers and the
activations saved for backward (not the process: Python, torch and Ray). The plan calls a stage
fitting when its predicted footprint, with 10% for the allocator's fragmentation, is within 80% of
the budget (a 20% margin); each test checks that the measured footprint, with the same 10%, falls on
the same side of that line as the prediction for the stage chosen and for the stage rejected, so a
planner that sized activations from another batch, ignored offload, or misjudged the states would
fail here. Models: examples/gpt.py's GPT (fp32, AdamW) at sizes where the stages' footprints are
more than 5% apart on each side of the line."""
import functools
import logging

import pytest
import torch

import zeroray as zr
from examples import gpt
from zeroray.plan.footprint import FRAGMENTATION
from zeroray.runtime.auto_stage import MARGIN

pytestmark = pytest.mark.slow  # eight trainers of up to 19M parameters, at 2 and 4 workers


def model(d: int, layers: int, seq: int) -> torch.nn.Module:
    return gpt.GPT(gpt.GPTConfig(vocab_size=256, seq_len=seq, d_model=d, n_layers=layers, n_heads=4))


def loss(net, batch):
    idx, tgt = batch
    logits = net(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


def batch(rows: int, seq: int):
    g = torch.Generator().manual_seed(rows * 1000 + seq)
    return torch.randint(0, 256, (rows, seq), generator=g), torch.randint(0, 256, (rows, seq), generator=g)


def measured(trainer) -> int:
    """The largest worker's training tensors at the step's high point (the budget's meaning on CPU)."""
    return max(r["measured"]["total"] + r["gathered_params_peak"] + r["reduce_buffers"] + r["gather_buffers"]
               + r["activations_peak"] for r in trainer.memory_report())


def fits(peak: float, budget: float) -> bool:
    """The plan's rule ([Note: choosing a stage]) applied to a measured footprint."""
    return (1 + FRAGMENTATION) * peak <= (1 - MARGIN) * budget


def run(model_fn, zero, workers: int, data, steps: int = 1):
    trainer = zr.Trainer(model_fn, loss, zero=zero, scaling=zr.ScalingConfig(num_workers=workers))
    try:
        for _ in range(steps):  # the optimizer's state exists from the first step on
            trainer.step(data)
        peak = measured(trainer)
        print(f"stage {trainer.zero.stage} {zero.offload or 'in memory'}: {peak / 1e6:.1f} MB measured, "
              f"x{1 + FRAGMENTATION:g} = {(1 + FRAGMENTATION) * peak / 1e6:.1f} MB against the line")
        return trainer.zero.stage, peak
    finally:
        trainer.shutdown()


def auto_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if "stage='auto'" in r.getMessage())


def test_stage_0_fits_a_small_batch_and_nothing_fits_a_large_one(ray_local, caplog):
    caplog.set_level(logging.INFO, logger="zeroray")
    fn, budget = functools.partial(model, 256, 4, 128), 250e6
    auto = zr.ZeroConfig(stage="auto", memory_budget=budget)
    small, large = batch(2 * 4, 128), batch(2 * 16, 128)
    stage, peak = run(fn, auto, 2, small)
    assert stage == 0 and "stage 0 is the cheapest stage that fits" in auto_line(caplog)
    assert "micro-batch 4 x 128 tokens" in auto_line(caplog)  # sized from the batch given, not a default
    assert peak <= budget and fits(peak, budget)
    # the same model and budget, four times the rows: the activations alone no longer fit any stage
    trainer = zr.Trainer(fn, loss, zero=auto, scaling=zr.ScalingConfig(num_workers=2))
    try:
        with pytest.raises(ValueError, match=r"no ZeRO stage fits .*micro-batch 16 x 128 tokens"):
            trainer.step(large)
    finally:
        trainer.shutdown()
    _, smallest = run(fn, zr.ZeroConfig(stage=3), 2, large)  # the smallest footprint: over the line indeed
    assert not fits(smallest, budget)


def test_only_stage_3_fits(ray_local, caplog):
    caplog.set_level(logging.INFO, logger="zeroray")
    fn, budget, data = functools.partial(model, 256, 24, 32), 240e6, batch(4 * 1, 32)
    stage, peak = run(fn, zr.ZeroConfig(stage="auto", memory_budget=budget), 4, data)
    assert stage == 3, auto_line(caplog)
    assert "stage 2: " in auto_line(caplog) and "does not fit" in auto_line(caplog)
    assert peak <= budget and fits(peak, budget)
    _, rejected = run(fn, zr.ZeroConfig(stage=2), 4, data)
    assert not fits(rejected, budget)


def test_offload_makes_stage_2_fit(ray_local, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="zeroray")
    fn, budget, data = functools.partial(model, 512, 6, 32), 280e6, batch(2 * 1, 32)
    disk = dict(offload="disk", offload_dir=str(tmp_path), offload_chunk_bytes=2**20)
    trainer = zr.Trainer(fn, loss, zero=zr.ZeroConfig(stage="auto", memory_budget=budget),
                         scaling=zr.ScalingConfig(num_workers=2))
    try:  # in memory, not even stage 3 fits
        with pytest.raises(ValueError, match="no ZeRO stage fits"):
            trainer.step(data)
    finally:
        trainer.shutdown()
    _, in_memory = run(fn, zr.ZeroConfig(stage=2), 2, data)
    assert not fits(in_memory, budget)
    caplog.clear()
    stage, peak = run(fn, zr.ZeroConfig(stage="auto", memory_budget=budget, **disk), 2, data)
    line = auto_line(caplog)
    assert "offload='disk'" in line and "stage 2: " in line and stage in (1, 2), line
    assert peak <= budget and fits(peak, budget)
    # stage 1 holds the same gradient shard as stage 2 ([Note: stage data flow]): the plan takes the
    # simpler of two equal steps; stage 2 itself, with the state on disk, fits too
    _, offloaded = run(fn, zr.ZeroConfig(stage=2, **disk), 2, data)
    assert fits(offloaded, budget)
