"""The typed messages: the manifest's fields (checked once, a malformed field named), a manifest
written by an earlier release still loads, and the runtime's actor messages (runtime/records.py)."""
import dataclasses
import json
import os
import pickle

import pytest
import torch

from zeroray.checkpoint import (CheckpointError, Manifest, ManifestFields, commit, load_manifest,
                                load_resharded, verify_files, write_extra)
from zeroray.layout.arena import FlatLayout
from zeroray.engine.step_result import StepStats
from zeroray.runtime.records import Hops, SetupInfo, SplitInfo, StepRecord, WorkerSpec
from zeroray.runtime.execution.pipeline import PendingStep
from tests.unit.test_checkpoint_store import UNITS, shard_of, write_all

# manifest.json as the release before typed manifests wrote it (write_all(root, 3, world_size=2),
# plus write_extra of {"buf": ones(2, 2)}): files, sizes and digests are deterministic.
OLD_MANIFEST = (
    '{"format": "zeroray.checkpoint", "step": 3, "world_size": 2, "layout": {"world_size": 2, "units": '
    '[["a", [["a.w", [3, 3]], ["a.b", [3]]]], ["b", [["b.w", [5]]]]], "aliases": {}, "module_uses": '
    '{"a": ["a.w", "a.b"], "b": ["b.w"]}}, "shards": [{"file": "shard_00000.safetensors", "bytes": 280, '
    '"sha256": "ca499770aad4021ccb1cb75f2c40a9da5511a1bd036279e9cb2b9e7cb4191ff4"}, {"file": '
    '"shard_00001.safetensors", "bytes": 280, "sha256": '
    '"1e624ec7a0deb4397d2b05dc031f4a710b2ddeb4f9f80e4ff3feaab762e0dd68"}], "scalars": [{"step": 3, "rng": '
    '"rank0"}, {"step": 3, "rng": "rank1"}], "tensors": {"master": {"dtype": "F32", "shape": [9], "sharded": '
    'true}, "optim.exp_avg": {"dtype": "F32", "shape": [9], "sharded": true}}, "config": {"zero": '
    '"ZeroConfig(stage=2)", "seed": 0}, "data_position": 3, "extra": {"state_dict_keys": ["a.w", "a.b", '
    '"b.w", "buf"]}, "extra_tensors": {"file": "extra.safetensors", "bytes": 136, "sha256": '
    '"63760e6f21357924bc23d4fc0bca39ce44d731b84241a88ec1b1478679447061"}, "extra_keys": {"buf": {"dtype": '
    '"F32", "shape": [2, 2]}}, "created": 1796121989.7318394, "version": 1}')


def test_old_format_manifest_loads_and_reads_back_the_same(tmp_path):
    _, logical, _ = write_all(tmp_path, 3, world_size=2)
    write_extra(tmp_path, 3, {"buf": torch.ones(2, 2)})
    step_dir = tmp_path / "step_00000003"
    (step_dir / "manifest.json").write_text(OLD_MANIFEST)
    m = load_manifest(tmp_path / "step_00000003")
    assert (m.step, m.world_size, m.data_position, m.config["seed"]) == (3, 2, 3, 0)
    assert m.to_dict() == json.loads(OLD_MANIFEST)  # the JSON format is unchanged
    verify_files(str(step_dir), [e.file for e in m.files()])  # sizes and sha256 as recorded
    lay3 = FlatLayout(UNITS, 3)
    for rank in range(3):  # read back at another world size
        tensors, scalars = load_resharded(str(step_dir), lay3, rank)
        assert torch.equal(tensors["master"], shard_of(lay3, logical, rank))
        assert scalars["step"] == 3


def test_a_new_manifest_is_written_in_the_same_format(tmp_path):
    lay, _, infos = write_all(tmp_path, 3, world_size=2)
    infos.append(write_extra(tmp_path, 3, {"buf": torch.ones(2, 2)}))
    commit(tmp_path, 3, ManifestFields(layout=lay, config={"zero": "ZeroConfig(stage=2)", "seed": 0},
                                       data_position=3, extra={"state_dict_keys": ["a.w", "a.b", "b.w", "buf"]}),
           infos)
    written = json.loads((tmp_path / "step_00000003" / "manifest.json").read_text())
    old = json.loads(OLD_MANIFEST)
    assert list(written) == list(old)
    assert {k: v for k, v in written.items() if k != "created"} == {k: v for k, v in old.items() if k != "created"}


@pytest.mark.parametrize("fields, named", [
    ({"layout": FlatLayout(UNITS, 2), "data_position": -1}, "'data_position'=-1 must be an integer >= 0"),
    ({"layout": FlatLayout(UNITS, 2), "data_position": True}, "'data_position'=True must be an integer"),
    ({"layout": FlatLayout(UNITS, 2), "config": {"x": object()}}, "field 'config' must be a JSON-able dict"),
    ({"layout": FlatLayout(UNITS, 2), "extra": ["a"]}, "field 'extra' must be a dict, got list"),
    ({"layout": "step_3"}, "field 'layout' must be the FlatLayout of the saved shards, got str"),
    ({"layout": {"units": 5}}, "field 'layout' cannot be read as a FlatLayout"),
    ({"layout": FlatLayout(UNITS, 2), "world_size": 3}, "'world_size'=3 but the layout is for world_size=2"),
    ({"layout": FlatLayout(UNITS, 2), "lr": 0.1}, r"unknown keys \['lr'\]"),
    ({"config": {}}, "needs 'layout'"),
])
def test_malformed_manifest_fields_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        ManifestFields.of(fields)


def test_manifest_fields_are_frozen_copies():
    config = {"lr": [0.1]}
    fields = ManifestFields(layout=FlatLayout(UNITS, 2).to_dict(), config=config)
    assert isinstance(fields.layout, FlatLayout)  # a to_dict() is read once, here
    config["lr"].append(0.2)
    assert fields.config == {"lr": [0.1]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        fields.data_position = 4
    assert ManifestFields.of(fields) is fields


@pytest.mark.parametrize("key, value, named", [
    ("data_position", "3", "field 'data_position' must be int, got str"),
    ("step", 3.0, "field 'step' must be int, got float"),
    ("config", None, "field 'config' must be dict, got NoneType"),
    ("tensors", {"master": 9}, "field 'tensors' entry 'master' must be a dict, got int"),
    ("created", "today", "field 'created' must be a number"),
    ("data_position", -2, "data_position must be >= 0, got -2"),
])
def test_malformed_manifest_on_disk_names_the_field(key, value, named):
    d = json.loads(OLD_MANIFEST)
    d[key] = value
    with pytest.raises(CheckpointError, match=named):
        Manifest.from_dict(d, source="ckpt/step_00000003")


def test_a_manifest_is_frozen_and_checked_when_built():
    m = Manifest.from_dict(json.loads(OLD_MANIFEST))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.step = 4
    with pytest.raises(CheckpointError, match="world_size is 3 but there are 2 shard entries"):
        dataclasses.replace(m, world_size=3)


# --- runtime messages ----------------------------------------------------------------------------


def test_step_outputs_combine_into_a_step_result():
    outs = [StepRecord(StepStats(loss=loss, grad_norm=2.0, step=5, skipped=False, loss_scale=None, time_s=t),
                       hops=Hops(1.0, 2.0, 3.0 + t)) for loss, t in ((1.0, 0.5), (3.0, 0.25))]
    result = PendingStep.combine(outs)
    assert (result.loss, result.grad_norm, result.step, result.skipped, result.step_time_s) == (2.0, 2.0, 5, False, 0.5)
    assert outs[0].hops.as_dict() == {"actor_start": 1.0, "engine_start": 2.0, "engine_end": 3.5}


def test_actor_messages_are_frozen_and_travel_by_pickle():
    from zeroray.config import ZeroConfig

    spec = WorkerSpec(model_fn=torch.nn.Identity, loss_fn=len, optimizer=None, zero=ZeroConfig(), seed=1)
    named = spec.in_group("zr-1234")
    assert (spec.group_name, named.group_name, named.seed) == ("zr", "zr-1234", 1)
    lay = FlatLayout(UNITS, 2)
    info = SetupInfo(layout=lay, state_layout=lay, state_rank=1, state_dict_keys=("a.w",), build_s=0.1,
                     peak_rss_bytes=1)
    layout, rank = info.resize_target()
    assert rank == 1 and layout.same_params_as(lay)
    back = pickle.loads(pickle.dumps(info))
    assert back.layout.same_params_as(lay) and back.state_dict_keys == ("a.w",)
    for message, name in ((spec, "seed"), (info, "build_s"), (SplitInfo(has_next=False), "rows")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, name, 0)
