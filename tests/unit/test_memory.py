"""The paper's memory model (zeroray.memory.model): Figure 1 numbers, K, padding, the inverse,
activation estimates, parameter counting and every argument check."""
import pytest
import torch

import zeroray as zr
from zeroray.config import SGD, AdamW
from zeroray.memory.model import (ModelStateBytes, activation_bytes, count_params, estimate_memory,
                            max_params_that_fit, model_state_bytes, optimizer_state_bytes_per_param)

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1(stage, expected_gb):
    # 7.5B parameters, Nd = 64, fp16 mixed precision Adam (K = 12).
    assert round(estimate_memory(7.5e9, 64, stage, dtype="fp16") / GB, 1) == expected_gb


def test_paper_figure_1_exact_bytes():
    phi, nd = 7_500_000_000, 64
    assert estimate_memory(phi, nd, 0) == 16 * phi
    assert estimate_memory(phi, nd, 1) == 4 * phi + 12 * phi // nd
    assert estimate_memory(phi, nd, 2) == 2 * phi + 14 * phi // nd
    assert estimate_memory(phi, nd, 3) == 16 * phi // nd


def test_public_alias():
    assert zr.estimate_memory(num_params=7.5e9, num_workers=64, stage=3, dtype="fp16") == 1_875_000_000


def test_breakdown_by_category():
    b = model_state_bytes(1000, 4, 2, dtype="fp16")
    assert b == ModelStateBytes(params=2000, grads=2 * 250, optimizer=12 * 250)
    assert b.total == 2000 + 500 + 3000
    assert model_state_bytes(1000, 4, 0) == ModelStateBytes(2000, 2000, 12000)
    assert model_state_bytes(1000, 4, 1) == ModelStateBytes(2000, 2000, 3000)
    assert model_state_bytes(1000, 4, 3) == ModelStateBytes(500, 500, 3000)


def test_fp32_adam_is_k8():
    assert optimizer_state_bytes_per_param("adam", "fp32") == 8
    assert optimizer_state_bytes_per_param("adam", "fp16") == 12
    assert optimizer_state_bytes_per_param("adamw", "bf16") == 12
    assert model_state_bytes(1000, 1, 0, dtype="fp32") == ModelStateBytes(4000, 4000, 8000)
    assert estimate_memory(1000, 10, 3, dtype="fp32") == (4 + 4 + 8) * 100
    assert estimate_memory(1000, 10, 1, dtype="fp32") == 8000 + 8 * 100


def test_optimizer_kinds():
    assert optimizer_state_bytes_per_param("sgd", "fp32") == 0
    assert optimizer_state_bytes_per_param("sgd", "fp16") == 4  # the fp32 master only
    assert optimizer_state_bytes_per_param("sgd_momentum", "fp32") == 4
    assert optimizer_state_bytes_per_param(3, "fp16") == 16
    assert optimizer_state_bytes_per_param("ADAM", "fp16") == 12
    # The config's optimizer specs say how much state they keep.
    assert optimizer_state_bytes_per_param(AdamW(), "fp32") == 8
    assert optimizer_state_bytes_per_param(SGD(momentum=0.9), "fp32") == 4


def test_grad_dtype_overrides_grad_bytes():
    b = model_state_bytes(1000, 4, 1, dtype="bf16", grad_dtype="fp32")
    assert (b.params, b.grads) == (2000, 4000)
    b = model_state_bytes(1000, 4, 2, dtype="bf16", grad_dtype="fp32")
    assert b.grads == 4 * 250


def test_uneven_split_rounds_up_to_whole_elements():
    assert model_state_bytes(10, 4, 3, dtype="fp32", optimizer="sgd").params == 4 * 3


def test_padded_numel_applies_to_sharded_terms_only():
    b = model_state_bytes(1000, 4, 1, padded_numel=1024)
    assert (b.params, b.grads, b.optimizer) == (2000, 2000, 12 * 256)
    b = model_state_bytes(1000, 4, 3, padded_numel=1024)
    assert b == ModelStateBytes(2 * 256, 2 * 256, 12 * 256)
    assert model_state_bytes(1000, 4, 0, padded_numel=1024) == model_state_bytes(1000, 4, 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("workers", [1, 3, 64])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_max_params_that_fit_is_the_inverse(stage, workers, dtype):
    budget = 32e9 + 12345
    n = max_params_that_fit(budget, workers, stage, dtype=dtype)
    assert estimate_memory(n, workers, stage, dtype=dtype) <= budget
    assert estimate_memory(n + 1, workers, stage, dtype=dtype) > budget


def test_max_params_that_fit_paper_table_1():
    # 32 GB V100: 2B without ZeRO, 7.6B with P_os and 128B with P_os+g+p at Nd = 64.
    assert round(max_params_that_fit(32e9, 64, 0) / 1e9, 1) == 2.0
    assert round(max_params_that_fit(32e9, 64, 1) / 1e9, 1) == 7.6
    assert round(max_params_that_fit(32e9, 64, 2) / 1e9, 1) == 14.4
    assert round(max_params_that_fit(32e9, 64, 3) / 1e9, 1) == 128.0
    assert max_params_that_fit(0, 4, 3) == 0


SHAPE = dict(layers=24, hidden=1024, seq_len=1024, batch=8)


def test_activation_formula():
    s, b, h, a, L = 1024, 8, 1024, 16, 24
    assert activation_bytes(**SHAPE, heads=a) == L * (s * b * h * 34 + 5 * a * s * s * b)
    assert activation_bytes(**SHAPE) == L * s * b * h * 34  # no heads: fused attention
    assert activation_bytes(**SHAPE, dtype="fp32") == 2 * activation_bytes(**SHAPE)


def test_activation_checkpointing_reduces_bytes():
    full = activation_bytes(**SHAPE, heads=16)
    ckpt = activation_bytes(**SHAPE, heads=16, checkpointing=True)
    part = activation_bytes(**SHAPE, heads=16, checkpointing=True, partitioned_over=8)
    off = activation_bytes(**SHAPE, heads=16, checkpointing=True, offload=True)
    assert full > ckpt > part > off
    one_layer = full // 24
    assert ckpt == 24 * 1024 * 8 * 1024 * 2 + one_layer
    assert part == 24 * 1024 * 8 * 1024 * 2 // 8 + one_layer
    assert off == one_layer
    # Without checkpoints there is nothing to partition.
    assert activation_bytes(**SHAPE, partitioned_over=8) == activation_bytes(**SHAPE)


def test_count_params_ties_and_callables():
    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

    assert count_params(Tied()) == 40 + 20
    assert count_params(Tied(), trainable_only=True) == 40
    assert count_params(Tied) == 60  # a zero-argument callable, built on the meta device
    assert count_params(f"{__name__}:_linear") == 6


def _linear():
    return torch.nn.Linear(2, 2)


def _not_a_model():
    return 3


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "module:function"),
    ("no_such_module_xyz:f", "cannot import"),
    (f"{__name__}:missing", "no attribute"),
    (f"{__name__}:_not_a_model", "not an nn.Module"),
    (42, "nn.Module"),
])
def test_count_params_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        count_params(spec)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_params=1e9, num_workers=4, stage=4), "stage"),
    (dict(num_params=1e9, num_workers=4, stage=True), "stage"),
    (dict(num_params=1e9, num_workers=0, stage=1), "num_workers"),
    (dict(num_params=1e9, num_workers=2.0, stage=1), "num_workers"),
    (dict(num_params=-1, num_workers=4, stage=1), "num_params"),
    (dict(num_params=float("nan"), num_workers=4, stage=1), "num_params"),
    (dict(num_params="7.5e9", num_workers=4, stage=1), "num_params"),
    (dict(num_params=1e9, num_workers=4, stage=1, dtype="fp8"), "dtype"),
    (dict(num_params=1e9, num_workers=4, stage=1, grad_dtype="int8"), "grad_dtype"),
    (dict(num_params=1e9, num_workers=4, stage=1, optimizer="lion"), "optimizer"),
    (dict(num_params=1e9, num_workers=4, stage=1, optimizer=-1), "optimizer"),
])
def test_estimate_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        estimate_memory(**kwargs)
    with pytest.raises(ValueError, match=name):
        model_state_bytes(**kwargs)


@pytest.mark.parametrize("padded", [999, 1001, 1024.0, True])
def test_padded_numel_errors(padded):
    with pytest.raises(ValueError, match="padded_numel"):
        model_state_bytes(1000, 4, 3, padded_numel=padded)


@pytest.mark.parametrize("kwargs, name", [
    (dict(memory_bytes=-1, num_workers=4, stage=1), "memory_bytes"),
    (dict(memory_bytes=float("inf"), num_workers=4, stage=1), "memory_bytes"),
    (dict(memory_bytes=32e9, num_workers=0, stage=1), "num_workers"),
    (dict(memory_bytes=32e9, num_workers=4, stage=-1), "stage"),
    (dict(memory_bytes=32e9, num_workers=4, stage=1, dtype="fp64"), "dtype"),
])
def test_max_params_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        max_params_that_fit(**kwargs)


def test_optimizer_state_bytes_errors():
    with pytest.raises(ValueError, match="optimizer"):
        optimizer_state_bytes_per_param("rmsprop", "fp16")
    with pytest.raises(ValueError, match="dtype"):
        optimizer_state_bytes_per_param("adam", "float16")


@pytest.mark.parametrize("change, name", [
    (dict(layers=0), "layers"),
    (dict(hidden=-4), "hidden"),
    (dict(seq_len=1.5), "seq_len"),
    (dict(batch=None), "batch"),
    (dict(heads=0), "heads"),
    (dict(dtype="int8"), "dtype"),
    (dict(partitioned_over=0), "partitioned_over"),
    (dict(checkpointing="yes"), "checkpointing"),
    (dict(offload=1, checkpointing=True), "offload"),
    (dict(offload=True), "offload"),  # nothing to offload without checkpoints
])
def test_activation_errors(change, name):
    with pytest.raises(ValueError, match=name):
        activation_bytes(**{**SHAPE, **change})


def test_offload_to_disk_leaves_the_disk_tiers_buffers():
    """offload="disk": the optimizer term (state, and the fp32 master in mixed precision) leaves
    memory, three chunks of every file stay ([Note: disk offload] in zeroray/offload/stepper.py)."""
    phi, nd, chunk = 10**9, 4, 12 * 2**20
    # bf16 Adam: 3 files (exp_avg, exp_avg_sq, master) of 1 Mi elements per chunk; at stage 3
    # the parameter shard is in a file too ([Note: parameter shard on disk]): the gradient stays
    buffers = 3 * 3 * 4 * 2**20
    assert estimate_memory(phi, nd, 3, "bf16", offload="disk", offload_chunk_bytes=chunk) == 2 * phi // nd + buffers
    assert estimate_memory(phi, nd, 1, "bf16", offload="disk", offload_chunk_bytes=chunk) == 4 * phi + buffers
    # fp32 Adam: 2 files (the master is the parameters, counted under P)
    assert estimate_memory(phi, nd, 2, "fp32", offload="disk", offload_chunk_bytes=8 * 2**20) == \
        4 * phi + 4 * phi // nd + 3 * 2 * 4 * 2**20
    # ... but at stage 3 the master goes to disk with the shard: 3 files, none of P
    assert estimate_memory(phi, nd, 3, "fp32", offload="disk", offload_chunk_bytes=chunk) == \
        4 * phi // nd + 3 * 3 * 4 * 2**20
    # plain SGD in fp32: no files, nothing held (stages 0-2); at stage 3 the master's file, of 16 MiB chunks
    assert estimate_memory(phi, nd, 2, "fp32", "sgd", offload="disk") == 4 * phi + 4 * phi // nd
    assert estimate_memory(phi, nd, 3, "fp32", "sgd", offload="disk") == 4 * phi // nd + 3 * 16 * 2**20
    # a shard smaller than a chunk holds a chunk of its size
    assert estimate_memory(1000, 2, 3, "bf16", offload="disk") == 2 * 500 + 3 * 3 * 4 * 500
    # "cpu", the GPU host-memory tier (on paper: not built), leaves the device what the disk tier leaves memory
    assert estimate_memory(phi, nd, 3, offload="cpu") == estimate_memory(phi, nd, 3, offload="disk")
    with pytest.raises(ValueError, match="offload='nvme' is invalid"):
        estimate_memory(phi, nd, 3, offload="nvme")
