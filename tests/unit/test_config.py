"""Config validation: every bad value raises a ValueError that names the field and what is allowed."""
import math

import pytest

import zeroray as zr
from zeroray.config import validate_optimizer

NAN = float("nan")

BAD = [
    # (config class, field, bad value, words the message must contain)
    (zr.ZeroConfig, "stage", 4, "choose 0"),
    (zr.ZeroConfig, "stage", -1, "choose 0"),
    (zr.ZeroConfig, "stage", 1.0, "choose 0"),
    (zr.ZeroConfig, "stage", True, "choose 0"),
    (zr.ZeroConfig, "dtype", "float16", "fp16"),
    (zr.ZeroConfig, "reduce_dtype", "int8", "fp32"),
    (zr.ZeroConfig, "bucket_bytes", 0, "positive number of bytes"),
    (zr.ZeroConfig, "bucket_bytes", -4096, "positive number of bytes"),
    (zr.ZeroConfig, "bucket_bytes", 1.5e6, "positive number of bytes"),
    (zr.ZeroConfig, "bucket_bytes", "large", "'auto'"),
    (zr.ZeroConfig, "bucket_timeout_ms", 0, "> 0 or None"),
    (zr.ZeroConfig, "bucket_timeout_ms", -5.0, "> 0 or None"),
    (zr.ZeroConfig, "bucket_timeout_ms", NAN, "> 0 or None"),
    (zr.ZeroConfig, "bucket_timeout_ms", "5ms", "> 0 or None"),
    (zr.ZeroConfig, "prefetch_bytes", 0, "positive number of bytes"),
    (zr.ZeroConfig, "max_live_bytes", -1, "positive number of bytes"),
    (zr.ZeroConfig, "reuse_distance", -1, ">= 0"),
    (zr.ZeroConfig, "grad_accum_steps", 0, ">= 1"),
    (zr.ZeroConfig, "grad_accum_steps", 2.0, ">= 1"),
    (zr.ZeroConfig, "max_grad_norm", 0.0, "> 0"),
    (zr.ZeroConfig, "max_grad_norm", NAN, "> 0"),
    (zr.ZeroConfig, "initial_loss_scale", -1.0, "> 0"),
    (zr.ZeroConfig, "min_loss_scale", 0, "> 0"),
    (zr.ZeroConfig, "loss_scale_growth_factor", 1.0, "> 1"),
    (zr.ZeroConfig, "loss_scale_backoff_factor", 1.5, "(0, 1)"),
    (zr.ZeroConfig, "loss_scale_growth_interval", 0, ">= 1"),
    (zr.ZeroConfig, "activation_checkpointing", "blocks", "nn.Module classes"),
    (zr.ZeroConfig, "activation_checkpointing", (1, 2), "nn.Module classes"),
    (zr.ZeroConfig, "collective_timeout_s", 0, "> 0"),
    (zr.ZeroConfig, "collective_timeout_s", math.inf, "> 0"),
    (zr.ZeroConfig, "cast_buffers", "auto", "None (the automatic rule"),
    (zr.ZeroConfig, "cast_buffers", 1, "True (cast every buffer) or False"),
    (zr.ZeroConfig, "offload", "nvme", "choose None (optimizer state in memory) or 'disk'"),
    (zr.ZeroConfig, "offload", True, "choose None (optimizer state in memory) or 'disk'"),
    (zr.ZeroConfig, "offload", "cpu", "not built yet"),
    (zr.ZeroConfig, "offload_chunk_bytes", 100, "an int >= 256"),
    (zr.ScalingConfig, "num_workers", 0, ">= 1"),
    (zr.ScalingConfig, "num_workers", -2, ">= 1"),
    (zr.ScalingConfig, "num_workers", 2.5, ">= 1"),
    (zr.ScalingConfig, "use_gpu", "yes", "True or False"),
    (zr.ScalingConfig, "cpus_per_worker", 0, "> 0"),
    (zr.ScalingConfig, "min_workers", 0, ">= 1"),
    (zr.ScalingConfig, "placement_strategy", "pack", "PACK"),
    (zr.ScalingConfig, "placement_timeout_s", -1, "> 0"),
    (zr.ScalingConfig, "threads_per_worker", 0, ">= 1"),
    (zr.FailureConfig, "max_failures", -1, ">= 0"),
    (zr.FailureConfig, "max_failures", 1.5, ">= 0"),
    (zr.CheckpointConfig, "path", "", "non-empty"),
    (zr.CheckpointConfig, "keep", 0, ">= 1"),
    (zr.AdamW, "lr", -1e-3, ">= 0"),
    (zr.AdamW, "lr", NAN, ">= 0"),
    (zr.AdamW, "betas", (0.9, 1.0), "[0, 1)"),
    (zr.AdamW, "betas", 0.9, "[0, 1)"),
    (zr.AdamW, "eps", 0, "> 0"),
    (zr.AdamW, "weight_decay", -0.1, ">= 0"),
    (zr.Adam, "lr", "0.001", ">= 0"),
    (zr.SGD, "lr", -1, ">= 0"),
    (zr.SGD, "momentum", -0.9, ">= 0"),
    (zr.SGD, "dampening", -1, ">= 0"),
    (zr.SGD, "weight_decay", -1, ">= 0"),
]


@pytest.mark.parametrize("cls, field, value, words", BAD,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in BAD])
def test_bad_value_names_the_field(cls, field, value, words):
    with pytest.raises(ValueError) as info:
        cls(**{field: value})
    message = str(info.value)
    assert f"{cls.__name__}.{field}=" in message, message
    assert words in message, message


def test_cross_field_rules_name_the_field():
    with pytest.raises(ValueError, match=r"ScalingConfig\.min_workers=3 .*<= num_workers \(2\)"):
        zr.ScalingConfig(num_workers=2, min_workers=3)
    with pytest.raises(ValueError, match=r"CheckpointConfig\.every_steps=10 .*set CheckpointConfig\.path"):
        zr.CheckpointConfig(every_steps=10)
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_dir='/tmp' .*only used with offload='disk'"):
        zr.ZeroConfig(offload_dir="/tmp")
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_dir=3 .*a directory path"):
        zr.ZeroConfig(offload="disk", offload_dir=3)
    with pytest.raises(ValueError, match=r"SGD\.nesterov=True .*momentum > 0"):
        zr.SGD(nesterov=True)


def test_given_placement_bundles_are_checked():
    """ScalingConfig(placement_group=..., placement_bundles=...): one distinct bundle per worker (what
    the bundles hold is checked against the placement group when the workers start)."""
    pg = object()  # the config only holds it; tests/ray/test_given_placement.py uses a real one
    with pytest.raises(ValueError, match=r"placement_bundles=\(1, 2\) .*placement_group=, which is not given"):
        zr.ScalingConfig(placement_bundles=(1, 2))
    with pytest.raises(ValueError, match=r"placement_bundles=\(1, 1\) .*distinct bundle indices"):
        zr.ScalingConfig(placement_group=pg, placement_bundles=(1, 1))
    with pytest.raises(ValueError, match=r"placement_bundles=\(1, -1\) .*distinct bundle indices >= 0"):
        zr.ScalingConfig(placement_group=pg, placement_bundles=(1, -1))
    with pytest.raises(ValueError, match=r"placement_bundles=\(1, 2, 3\) .*one bundle per worker \(num_workers=2\)"):
        zr.ScalingConfig(placement_group=pg, placement_bundles=(1, 2, 3))
    given = zr.ScalingConfig(placement_group=pg, placement_bundles=[1, 2])
    assert given.placement_bundles == (1, 2) and "placement_group" not in repr(given)  # a live handle: not in repr


def test_defaults_and_good_values_pass():
    zr.ZeroConfig()
    zr.ZeroConfig(stage=0, dtype="bf16", reduce_dtype="fp32", max_grad_norm=1.0, activation_checkpointing=True)
    zr.ZeroConfig(bucket_bytes="auto", bucket_timeout_ms=2.5)
    zr.ZeroConfig(offload="disk")  # offload_dir None: the system's temporary directory
    assert zr.ZeroConfig(offload="disk", offload_dir=__import__("pathlib").Path("/tmp")).offload_dir == "/tmp"
    assert zr.ZeroConfig().cast_buffers is None  # the automatic rule of zeroray/engine/precision.py
    zr.ZeroConfig(dtype="bf16", cast_buffers=True)
    zr.ZeroConfig(dtype="fp16", cast_buffers=False)
    assert zr.ZeroConfig(bucket_bytes="auto").base_bucket_bytes == zr.ZeroConfig().bucket_bytes
    zr.ScalingConfig(num_workers=4, min_workers=2, cpus_per_worker=0.5, use_gpu=True)
    zr.FailureConfig(max_failures=0)
    zr.CheckpointConfig(path="ckpts/", every_steps=5, keep=1)
    zr.SGD(lr=0.1, momentum=0.9, nesterov=True)


def test_configs_are_frozen_and_keyword_only():
    config = zr.ZeroConfig(stage=2)
    with pytest.raises(Exception):
        config.stage = 3
    with pytest.raises(TypeError):
        zr.ZeroConfig(2)


@pytest.mark.parametrize("spec, words", [("adamw", "pass zr.AdamW"), (3e-4, "pass zr.AdamW"),
                                         (zr.AdamW.__mro__[0], "is a class")])
def test_invalid_optimizer_spec(spec, words):
    with pytest.raises(ValueError, match=words):
        validate_optimizer(spec)
    validate_optimizer(zr.SGD(lr=0.1))
    validate_optimizer(lambda params: None)  # any callable params -> Optimizer (checked when built)


@pytest.mark.parametrize("cls, kwargs, field", [
    (zr.ZeroConfig, dict(prefetch="no"), "prefetch"),
    (zr.ZeroConfig, dict(offload_activations=1), "offload_activations"),
    (zr.ZeroConfig, dict(sharded_init="x"), "sharded_init"),
    (zr.ZeroConfig, dict(broadcast_buffers="rank0"), "broadcast_buffers"),
    (zr.ZeroConfig, dict(broadcast_buffers=None), "broadcast_buffers"),
    (zr.ZeroConfig, dict(reuse_distance=True), "reuse_distance"),
    (zr.ZeroConfig, dict(loss_scale_growth_factor=float("inf")), "loss_scale_growth_factor"),
    (zr.AdamW, dict(weight_decay=float("nan")), "weight_decay"),
    (zr.SGD, dict(momentum=float("nan")), "momentum"),
    (zr.SGD, dict(nesterov="yes"), "nesterov"),
])
def test_type_and_nan_gaps_are_errors(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)
