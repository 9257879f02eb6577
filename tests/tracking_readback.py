"""Reading back what the trackers of zeroray.tracking wrote, each with its own package's reader:
``{name: {step: value}}`` per run (tests/ray/test_tracking.py, tests/unit/test_tracking.py).

W&B 0.31 has no public reader for an offline run (the old ``wandb.sdk.internal.datastore`` is
gone; the Public API reads the server only), so ``wandb_history`` reads the run's transaction log
(``run-<id>.wandb``) by its format, LevelDB's log format with a ``:W&B`` header
(https://github.com/google/leveldb/blob/main/doc/log_format.md), and parses each record with W&B's
own protobuf classes (``wandb.proto.wandb_internal_pb2.Record``). pyproject.toml pins wandb's minor
release for this.
"""
import glob
import json
import os
import struct
import time
import zlib
from typing import Dict, List

Series = Dict[str, Dict[int, float]]


def tensorboard_scalars(log_dir) -> Series:
    """The scalars of every event file under ``log_dir``, as TensorBoard's EventAccumulator reads them
    (float32, as TensorBoard stores scalars; EventAccumulator drops the points a replay orphaned)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out: Series = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(tag, {})[event.step] = event.value
    return out


def as_float32(series: Series) -> Series:
    """What TensorBoard keeps of each value: the nearest float32 (as a Python float)."""
    return {name: {step: struct.unpack("f", struct.pack("f", value))[0] for step, value in points.items()}
            for name, points in series.items()}


def mlflow_runs(tracking_uri, experiment="zeroray"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    return client, ([] if found is None else client.search_runs([found.experiment_id]))


def mlflow_history(tracking_uri, run_id) -> Dict[str, List[tuple]]:
    """Every metric's full history: ``{name: [(step, value), ...]}`` in the order logged."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                   key=lambda m: (m.timestamp, m.step))]
            for key in run.data.metrics}


def wandb_run_files(wandb_dir) -> List[str]:
    return sorted(glob.glob(os.path.join(str(wandb_dir), "wandb", "*run-*", "run-*.wandb")))


def _records(path):
    block, header = 32768, 7
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:header])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if pos + header + length > len(data):  # the writer is still on it
            return
        body = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, "corrupt record"
        pending += body
        if kind in (1, 4):  # FULL or LAST: a whole record
            yield pending
            pending = b""


def _parsed(run_file):
    from wandb.proto import wandb_internal_pb2

    for raw in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def wandb_history(run_file, timeout_s=120.0) -> Series:
    """The history rows of a finished offline W&B run: ``{name: {step: value}}``. W&B's own process
    (wandb-core) writes the log, and may still be writing it when ``run.finish()`` has returned:
    the rows are read once the run's ``exit`` record is there."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in _parsed(run_file)):
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout_s} s"
        time.sleep(0.2)
    out: Series = {}
    for record in _parsed(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):  # W&B's own (_step, _runtime, _timestamp)
                out.setdefault(key, {})[step] = json.loads(item.value_json)
    return out
