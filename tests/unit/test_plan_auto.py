"""``ZeroConfig(stage="auto")``: what it reads of the run (the first batch, the accumulation, the
offload, the GPU by name and memory) and when it starts the workers. The runs against a memory budget
are tests/ray/test_stage_auto.py's."""
import logging

import pytest
import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model
from zeroray import plan
from zeroray.plan.hardware import preset_for_device
from zeroray.runtime.auto_stage import batch_shape, first_batch, gpu_cluster
from zeroray.runtime.trainer_state import TrainerState


def test_auto_is_a_valid_stage_and_a_budget_needs_it():
    assert zr.ZeroConfig(stage="auto").stage == "auto"
    assert zr.ZeroConfig(stage="auto", memory_budget=2e9).memory_budget == 2e9
    with pytest.raises(ValueError, match="'auto'"):
        zr.ZeroConfig(stage="fast")
    with pytest.raises(ValueError, match="memory_budget.*set stage='auto'"):
        zr.ZeroConfig(stage=2, memory_budget=2e9)
    with pytest.raises(ValueError, match="memory_budget"):
        zr.ZeroConfig(stage="auto", memory_budget=-1)


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("Tesla V100-SXM2-16GB", "v100-32gb"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_speed_from_a_preset_only_when_the_name_matches(name, preset):
    assert preset_for_device(name) == preset


def test_gpu_memory_is_the_devices_and_an_unknown_gpu_says_so():
    v100, how = gpu_cluster("Tesla V100-SXM2-16GB", 16 * 2**30, None)
    assert v100.memory_bytes == 16 * 2**30 and v100.peak_flops == plan.cluster_preset("v100-32gb").peak_flops
    assert "'v100-32gb' preset's speed" in how
    a100, how = gpu_cluster("NVIDIA A100-SXM4-40GB", 40 * 2**30, None)
    assert a100.name == "unknown-gpu" and a100.memory_bytes == 40 * 2**30
    assert "none of zeroray.plan's presets" in how and "conservative" in how
    budget, _ = gpu_cluster("NVIDIA H200", 141e9, 50e9)  # a budget counts training's tensors: no context
    assert budget.memory_bytes == 50e9 and budget.context_bytes == 0


def test_batch_shape_is_rows_per_micro_batch_and_sequence_length():
    ids = torch.zeros(16, 128, dtype=torch.long)
    assert batch_shape((ids, ids), workers=2, accum=1) == (8, 128)
    assert batch_shape({"input_ids": ids, "labels": ids}, workers=2, accum=4) == (2, 128)
    assert batch_shape({"x": torch.zeros(12, 3, 7)}, workers=3, accum=1) == (4, 3)  # dim 1, whatever it is
    assert batch_shape(torch.zeros(6), workers=2, accum=1) == (3, 1)
    assert batch_shape({"note": "none"}, workers=2, accum=1) is None


def test_first_batch_leaves_the_data_whole():
    batches = make_batches(3)
    assert first_batch(batches)[0] is batches[0] and first_batch(batches)[1] is batches
    it = iter(batches)
    first, data = first_batch(it)
    assert first is batches[0] and list(data) == batches  # a one-shot iterator gets its first batch back
    assert first_batch([]) == (None, [])

    class Reiterable:
        def __iter__(self):
            return iter(batches)

    r = Reiterable()
    assert first_batch(r) == (batches[0], r)


def test_the_first_batch_and_accumulation_move_the_choice():
    """More rows per worker: more activations; accumulation: stages 0-1 keep autograd's full gradient
    between micro-batches. Both are the run's, and both change which stage fits."""
    from examples import gpt

    w = plan.from_module(lambda: gpt.GPT(gpt.GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_layers=4)),
                         seq_len=128)
    cpu = plan.cluster_preset("cpu", gpus_per_node=2, cores=8.0, memory_bytes=135e6, context_bytes=0.0)
    kw = dict(dtype="fp32", optimizer="adamw", bucket_bytes=16 * 2**20)
    # stages 1 and 2 hold the same gradient shard: without accumulation the simpler one is chosen
    assert plan.choose_stage(w, cpu, 2, micro_batch=4, **kw)[0] == 1
    stage, table, _ = plan.choose_stage(w, cpu, 2, micro_batch=4, accum=2, **kw)
    assert stage == 2 and not table["stages"]["1"]["fits"] and table["stages"]["2"]["fits"]
    with pytest.raises(ValueError, match=r"micro-batch 16 x 128 tokens"):
        plan.choose_stage(w, cpu, 2, micro_batch=16, **kw)


def test_offload_moves_the_choice_and_cpu_is_the_disk_layout_on_paper():
    w = plan.model_preset("llama-7b")
    h100 = plan.cluster_preset("h100", memory_bytes=40e9)
    with pytest.raises(ValueError, match="no ZeRO stage fits"):
        plan.choose_stage(w, h100, 2, checkpointing=True)
    stage, table, reason = plan.choose_stage(w, h100, 2, checkpointing=True, offload="disk")
    assert table["stages"][str(stage)]["fits"] and "offload='disk'" in reason
    disk = plan.simulate(w, h100, plan.RunConfig(2, 2, offload="disk"))
    cpu = plan.simulate(w, h100, plan.RunConfig(2, 2, offload="cpu"))
    memory = plan.simulate(w, h100, plan.RunConfig(2, 2))
    assert disk.memory["states"] == cpu.memory["states"] < memory.memory["states"]
    assert disk.optimizer_s > cpu.optimizer_s > memory.optimizer_s  # the tier's bytes at its bandwidth
    with pytest.raises(ValueError, match="offload"):
        plan.RunConfig(2, 2, offload="nvme")


def test_a_trainer_with_auto_starts_its_workers_on_its_first_batch(ray_local, caplog):
    caplog.set_level(logging.INFO, logger="zeroray")
    trainer = zr.Trainer(parity_model, lm_loss, zero=zr.ZeroConfig(stage="auto"),
                         scaling=zr.ScalingConfig(num_workers=2))
    try:
        assert trainer.zero.stage == "auto" and trainer.state is TrainerState.IDLE and trainer.step_count == 0
        assert not any("stage='auto'" in r.getMessage() for r in caplog.records)  # nothing chosen yet
        batch = make_batches(1)[0]
        trainer.step(batch)
        line = next(r.getMessage() for r in caplog.records if "stage='auto'" in r.getMessage())
        assert trainer.zero.stage in (0, 1, 2, 3) and f"stage {trainer.zero.stage} is the cheapest" in line
        rows, seq = batch[0].shape
        assert f"micro-batch {rows // 2} x {seq} tokens" in line and "Ray's free memory" in line
        assert trainer.step_count == 1
    finally:
        trainer.shutdown()
    closed = zr.Trainer(parity_model, lm_loss, zero=zr.ZeroConfig(stage="auto"), scaling=zr.ScalingConfig(num_workers=2))
    closed.shutdown()  # never started: nothing to release, and nothing starts after
    assert closed.state is TrainerState.CLOSED
    with pytest.raises(RuntimeError, match="shut down"):
        closed.step(make_batches(1)[0])


def test_first_batch_of_a_ray_dataset_is_its_first_global_batch(ray_local):
    import ray

    ds = ray.data.from_items([{"ids": torch.full((5,), i).numpy(), "label": i} for i in range(12)])
    batch, data = first_batch(ds, 8)
    assert data is ds and batch["ids"].shape == (8, 5) and batch_shape(batch, workers=2, accum=2) == (2, 5)
    assert first_batch(ds, None) == (None, ds)  # fit's own error says the batch size is missing
