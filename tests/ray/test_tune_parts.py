"""zeroray.tune's parts that need no Tune run (the sweeps themselves: tests/e2e/test_cluster_tune.py):
a trial's resources, what ``zt.trainable`` refuses, reading a Tune checkpoint where it lies, and
the staging check that refuses a checkpoint whose shards the trial's driver cannot see."""
import os

import pytest
from pyarrow import fs as pafs
from ray import tune

import zeroray as zr
import zeroray.tune as zt
from tests.models import lm_loss, make_batches, parity_model
from zeroray.checkpoint import StoragePath, load_manifest
from zeroray.tune.staging import Staging, check_whole, zeroray_path


def test_trial_resources_are_a_driver_bundle_then_one_per_worker():
    pgf = zt.trial_resources(zr.ScalingConfig(num_workers=3, cpus_per_worker=2, placement_strategy="SPREAD"))
    assert pgf.bundles == [{"CPU": 1.0}] + [{"CPU": 2.0}] * 3 and pgf.strategy == "SPREAD"
    gpu = zt.trial_resources(zr.ScalingConfig(num_workers=2, use_gpu=True), driver_cpus=0)
    assert gpu.head_bundle_is_empty and gpu.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    with pytest.raises(ValueError, match="driver_cpus=-1 must be a number >= 0"):
        zt.trial_resources(zr.ScalingConfig(), driver_cpus=-1)
    with pytest.raises(ValueError, match="set inside a trial"):
        zt.trial_resources(zr.ScalingConfig(num_workers=1, placement_group=object(), placement_bundles=(1,)))


def test_trainable_takes_config_and_trial():
    with pytest.raises(ValueError, match=r"two arguments, \(config, trial\): <lambda> takes \['config'\]"):
        zt.trainable(lambda config: None, zr.ScalingConfig())
    with pytest.raises(ValueError, match="must be a zr.ScalingConfig"):
        zt.trainable(lambda config, trial: None, {"num_workers": 2})
    with pytest.raises(RuntimeError, match="runs inside a Ray Tune trial"):
        zt.Trial(zr.ScalingConfig())
    sized = zt.trainable(lambda config, trial: None, lambda config: zr.ScalingConfig(num_workers=config["n"]))
    assert sized._resources({"n": 3}).bundles == [{"CPU": 1.0}] * 4  # what tune.with_resources asks per trial


def test_a_tune_checkpoint_is_read_where_it_lies(tmp_path):
    assert zeroray_path(tune.Checkpoint.from_directory(str(tmp_path))) == str(tmp_path)
    remote = zeroray_path(tune.Checkpoint(path=str(tmp_path), filesystem=pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())))
    assert isinstance(remote, StoragePath) and remote.path == str(tmp_path)


def test_staging_refuses_a_checkpoint_the_driver_does_not_see_whole(ray_local):
    staging = Staging(None, "t0")
    try:
        with zr.Trainer(parity_model, lm_loss, scaling=zr.ScalingConfig(num_workers=2)) as trainer:
            trainer.step(make_batches(1)[0])
            step_dir = staging.save(trainer)  # whole: passes
            assert load_manifest(step_dir).step == 1 and str(step_dir).startswith(staging.root)
            checkpoint = staging.checkpoint(step_dir)
            assert checkpoint.path == str(step_dir)
            shard = os.path.join(step_dir, "shard_00001.safetensors")
            os.remove(shard)  # as a worker on a node whose /tmp the driver does not see would leave it
            with pytest.raises(ValueError, match=r"shard_00001.safetensors .*does not see it.*staging=\.\.\."):
                check_whole(step_dir)
            staging.drop(step_dir)
            assert not os.path.exists(step_dir)
    finally:
        staging.close()
    assert not os.path.exists(staging.root)
