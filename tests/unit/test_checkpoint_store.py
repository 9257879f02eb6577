"""The save protocol on real files: commit, latest, retention, crash safety, damaged files,
and the same through a ``file://`` URI (pyarrow.fs). See [Note: checkpoint commit protocol]."""
import json
import os

import pytest
import safetensors.torch
import torch

from zeroray.layout.arena import FlatLayout
from zeroray.checkpoint import (CheckpointError, commit, latest_checkpoint, list_checkpoints,
                                load_extra, load_manifest, load_resharded, read_shard_slices,
                                write_extra, write_shard)
from zeroray.checkpoint.filesystem import resolve
from zeroray.checkpoint.tensorfile import TensorFileReader

UNITS = [("a", [("a.w", (3, 3)), ("a.b", (3,))]), ("b", [("b.w", (5,))])]


def shard_of(lay, logical, rank):
    shard = torch.zeros(lay.shard_numel)
    for unit, start in zip(lay.units, lay.logical_offsets()):
        lo, hi = unit.rank_range(rank)
        shard[unit.shard_offset:unit.shard_offset + hi - lo] = logical[start + lo:start + hi]
    return shard


def write_all(root, step, world_size=2, seed=0):
    """Every rank's write_shard for one step; returns (layout, logical master, infos)."""
    lay = FlatLayout(UNITS, world_size)
    logical = torch.randn(lay.numel, generator=torch.Generator().manual_seed(seed))
    infos = [write_shard(root, step, r, {"master": shard_of(lay, logical, r),
                                         "optim.exp_avg": shard_of(lay, 2 * logical, r)},
                         {"step": step, "rng": f"rank{r}"})
             for r in range(world_size)]
    return lay, logical, infos


def save(root, step, world_size=2, keep=None, seed=0):
    lay, logical, infos = write_all(root, step, world_size, seed)
    commit(root, step, {"layout": lay, "config": {"lr": 0.1}, "data_position": 5 * step,
                        "extra": {"note": "x"}}, infos, keep=keep)
    return lay, logical


def step_dir(root, step):
    return os.path.join(str(root), f"step_{step:08d}")


def test_round_trip_and_manifest_fields(tmp_path):
    lay, logical = save(tmp_path, 4, world_size=3)
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 4)
    assert open(tmp_path / "latest").read().strip() == "step_00000004"
    m = load_manifest(tmp_path)
    assert (m.step, m.world_size, m.config, m.data_position, m.extra) == (4, 3, {"lr": 0.1}, 20, {"note": "x"})
    assert m.scalars == [{"step": 4, "rng": f"rank{r}"} for r in range(3)]
    assert m.sharded_keys == ["master", "optim.exp_avg"]
    assert m.flat_layout().same_params_as(lay)
    assert load_manifest(step_dir(tmp_path, 4)).step == 4  # a step directory works too
    assert load_manifest(os.path.join(step_dir(tmp_path, 4), "manifest.json")).step == 4
    # Shard files are plain safetensors, readable by the library.
    plain = safetensors.torch.load_file(os.path.join(step_dir(tmp_path, 4), "shard_00001.safetensors"))
    assert torch.equal(plain["master"], shard_of(lay, logical, 1))
    # Sliced reads of one file.
    a, b = read_shard_slices(tmp_path, 1, "optim.exp_avg", [(0, 2), (3, 5)])
    assert torch.equal(a, shard_of(lay, 2 * logical, 1)[0:2])
    assert torch.equal(b, shard_of(lay, 2 * logical, 1)[3:5])


def test_uncommitted_step_is_ignored_and_the_previous_loads(tmp_path):
    _, logical1 = save(tmp_path, 1, seed=1)
    write_all(tmp_path, 2, seed=2)  # the "crash": shards written, commit never called
    (tmp_path / "step_00000002" / ".shard_00000.safetensors.tmp.deadbeef").write_bytes(b"half")
    (tmp_path / ".latest.tmp.cafe").write_bytes(b"step_00000002")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    tensors, scalars = load_resharded(tmp_path, FlatLayout(UNITS, 2), 0)
    assert scalars["step"] == 1
    assert torch.equal(tensors["master"], shard_of(FlatLayout(UNITS, 2), logical1, 0))
    with pytest.raises(CheckpointError, match="step_00000002 has no manifest.json"):
        load_manifest(step_dir(tmp_path, 2))
    # The next commit cleans the leftovers (temp files, the interrupted step below it).
    save(tmp_path, 3)
    assert not (tmp_path / ".latest.tmp.cafe").exists()
    assert not (tmp_path / "step_00000002").exists()


def test_rewriting_a_committed_step_invalidates_it_first(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    write_all(tmp_path, 2, seed=9)  # re-save of step 2 interrupted before its commit
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)  # `latest` names an incomplete dir
    assert load_manifest(tmp_path).step == 1


def test_latest_falls_back_to_the_newest_complete_step(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 7)
    (tmp_path / "latest").write_text("garbage\n")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 7)
    (tmp_path / "latest").unlink()
    assert load_manifest(tmp_path).step == 7
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 7]


def test_keep_deletes_older_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000003", "step_00000004"]
    save(tmp_path, 5, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]


def test_extra_file(tmp_path):
    lay, _, infos = write_all(tmp_path, 1)
    extra = {"frozen.w": torch.randn(2, 3), "buf": torch.arange(4), "flag": torch.tensor([True, False]),
             "half": torch.randn(3).to(torch.bfloat16)}
    infos.append(write_extra(tmp_path, 1, extra))
    commit(tmp_path, 1, {"layout": lay}, infos)
    got = load_extra(tmp_path)
    assert set(got) == set(extra)
    for k, v in extra.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert load_manifest(tmp_path).extra_keys["frozen.w"] == {"dtype": "F32", "shape": [2, 3]}
    plain = safetensors.torch.load_file(str(tmp_path / "step_00000001" / "extra.safetensors"))
    assert all(torch.equal(plain[k], v) for k, v in extra.items())


def test_reads_files_the_library_wrote(tmp_path):
    tensors = {"x": torch.randn(10), "i": torch.arange(6).reshape(2, 3), "h": torch.randn(5).half()}
    safetensors.torch.save_file(tensors, str(tmp_path / "lib.safetensors"))
    storage, path = resolve(tmp_path / "lib.safetensors")
    with storage.open_range(path) as f:
        reader = TensorFileReader(f)
        assert torch.equal(reader.read("i"), tensors["i"])
        assert torch.equal(reader.read("h"), tensors["h"])
        lo, hi = reader.read_flat_ranges("x", [(7, 9), (1, 3)])
        assert torch.equal(lo, tensors["x"][7:9]) and torch.equal(hi, tensors["x"][1:3])


# --- damaged checkpoints -------------------------------------------------------------------------


def damage(tmp_path, how):
    save(tmp_path, 1)
    path = tmp_path / "step_00000001" / "shard_00001.safetensors"
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[:-7])
    elif how == "flip":
        data[-3] ^= 0x10
        path.write_bytes(data)
    else:
        path.unlink()
    return path


@pytest.mark.parametrize("how,expected", [
    ("truncate", r"has \d+ bytes but the manifest says \d+: it is truncated"),
    ("flip", "is corrupted: sha256"),
    ("missing", r"is missing \(the manifest lists it with \d+ bytes\)"),
])
def test_damaged_shard_is_named(tmp_path, how, expected):
    path = damage(tmp_path, how)
    with pytest.raises(CheckpointError, match=expected) as info:
        load_resharded(tmp_path, FlatLayout(UNITS, 2), 1)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_without_verify_a_truncated_file_is_still_caught(tmp_path):
    damage(tmp_path, "truncate")
    with pytest.raises(CheckpointError, match="truncated"):
        load_resharded(tmp_path, FlatLayout(UNITS, 2), 1, verify=False)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="is not a zeroray checkpoint"):
        load_manifest(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_manifest(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint"):
        load_manifest(tmp_path / "notes.txt")
    (tmp_path / "step_00000003").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        load_manifest(tmp_path)


def test_damaged_manifest(tmp_path):
    save(tmp_path, 1)
    manifest = tmp_path / "step_00000001" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[:40])
    with pytest.raises(CheckpointError, match=r"manifest.json: not valid JSON"):
        load_manifest(tmp_path)
    d = json.loads(text)
    d["version"] = 99
    manifest.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="version 99 is not supported"):
        load_manifest(tmp_path)
    d["version"] = 1
    d["world_size"] = 3
    manifest.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="world_size is 3 but there are 2 shard entries"):
        load_manifest(tmp_path)


def test_commit_checks_what_it_is_given(tmp_path):
    lay, _, infos = write_all(tmp_path, 1, world_size=2)
    with pytest.raises(ValueError, match=r"one ShardInfo per rank .*got ranks \[0\], missing \[1\]"):
        commit(tmp_path, 1, {"layout": lay}, infos[:1])
    with pytest.raises(ValueError, match=r"N=3.*got ranks \[0, 1\], missing \[2\]"):
        commit(tmp_path, 1, {"layout": lay.with_world_size(3)}, infos)
    with pytest.raises(ValueError, match=r"unknown keys \['lr'\]"):
        commit(tmp_path, 1, {"layout": lay, "lr": 1}, infos)
    with pytest.raises(ValueError, match="another layout"):
        commit(tmp_path, 1, {"layout": FlatLayout(UNITS[:1], 2)}, infos)
    with pytest.raises(ValueError, match="not JSON-able"):
        write_shard(tmp_path, 1, 0, {"master": torch.zeros(3)}, {"bad": object()})
    assert latest_checkpoint(tmp_path) is None  # nothing was committed


# --- pyarrow.fs ----------------------------------------------------------------------------------


def test_file_uri_through_pyarrow(tmp_path):
    root = f"file://{tmp_path}/ckpt"
    lay, logical = save(root, 2, world_size=3, keep=1)
    save(root, 3, world_size=3, keep=1)
    assert latest_checkpoint(root) == f"{root}/step_00000003"
    assert load_manifest(root).source == f"{root}/step_00000003"
    new = FlatLayout(UNITS, 2)
    tensors, _ = load_resharded(root, new, 1)
    assert torch.equal(tensors["master"], shard_of(new, logical, 1))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_00000003"]


def test_object_store_writes_go_straight_to_the_final_name(tmp_path):
    storage, path = resolve(f"file://{tmp_path}/obj.bin")
    storage.atomic_rename = False  # what S3/GCS get: no rename, the upload itself is atomic
    with storage.atomic_writer(path) as out:
        out.write(b"abc")
    assert (tmp_path / "obj.bin").read_bytes() == b"abc"
    with pytest.raises(RuntimeError):
        with storage.atomic_writer(path + "2") as out:
            out.write(b"partial")
            raise RuntimeError("writer died")
    assert sorted(os.listdir(tmp_path)) == ["obj.bin"]


def test_failed_local_write_leaves_nothing(tmp_path):
    storage, path = resolve(tmp_path / "f.bin")
    with pytest.raises(RuntimeError):
        with storage.atomic_writer(path) as out:
            out.write(b"partial")
            raise RuntimeError("writer died")
    assert os.listdir(tmp_path) == []
