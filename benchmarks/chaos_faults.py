"""Where the chaos run's faults land: gates that stop a worker at a known point until it is hit.

A fault on a timer races the steps; a fault at a gate does not. A gate is a small file in the
run's control directory that names a point: "the worker process with this pid, in ``loss_fn``,
on the batch with these rows" (``gated_loss``), or "the first process to write (or read) a
checkpoint file whose path contains this" (``ChaosStorage``). The process that reaches the
point says so (a ``*.blocked`` file with its pid) and waits there; only then does the chaos
driver kill it, stop it or take its node away, so the fault lands inside that very step, save
or restore on any machine, and a seed repeats the run.

``ChaosStorage`` also writes down every value the driver gives ``latest``, so the run can check
at the end that every checkpoint ``latest`` ever named still loads.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from typing import BinaryIO, Iterator, List, Optional

from zeroray.checkpoint.faults import StorageWrapper
from zeroray.checkpoint.filesystem import RangeFile

POLL_S = 0.02


def fingerprint(tensor) -> str:
    return hashlib.sha1(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def _publish(path: str, text: str) -> None:
    """Write ``path`` so that a reader sees all of ``text`` or no file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


# --- a step: the loss function's gate ---------------------------------------------------------


def gated_loss(control_dir: str, loss_fn, model, batch):
    """``loss_fn(model, batch)``, except that the process named in ``<control_dir>/loss.gate``
    ("pid fingerprint") waits here on the batch named there, after writing ``loss.blocked``,
    for as long as the gate names it (the driver kills it, or stops and later resumes it)."""
    gate = os.path.join(control_dir, "loss.gate")
    if os.path.exists(gate):
        me = f"{os.getpid()} {fingerprint(batch[0])}"
        if _read(gate) == me:
            _publish(os.path.join(control_dir, "loss.blocked"), me)
            while _read(gate) == me:
                time.sleep(POLL_S)
    return loss_fn(model, batch)


# --- a save or a restore: the storage's gate ----------------------------------------------------


class ChaosStorage(StorageWrapper):
    """The local filesystem, with a gate on writes and reads, and a log of ``latest``.

    ``<control_dir>/io.gate`` holds "write <text>" or "read <text>": the first process to write
    (or open for reading) a file whose path contains <text> takes the gate (an atomic rename,
    so exactly one does), writes ``io.blocked`` with its pid and waits until it is killed."""

    def __init__(self, control_dir: str) -> None:
        super().__init__()
        self.control_dir = control_dir

    def _gate(self, op: str, path: str) -> None:
        gate = os.path.join(self.control_dir, "io.gate")
        wanted = _read(gate)
        if wanted is None:
            return
        kind, _, text = wanted.partition(" ")
        if kind != op or text not in path:
            return
        try:
            os.rename(gate, os.path.join(self.control_dir, f"io.taken.{os.getpid()}"))
        except FileNotFoundError:
            return  # another process took it
        _publish(os.path.join(self.control_dir, "io.blocked"), f"{os.getpid()} {op} {path}")
        while True:  # until the driver kills this process
            time.sleep(POLL_S)

    @contextlib.contextmanager
    def atomic_writer(self, path: str) -> Iterator[BinaryIO]:
        self._gate("write", path)
        with self.inner.atomic_writer(path) as stream:
            yield stream
        if os.path.basename(path) == "latest":
            with open(os.path.join(self.control_dir, "latest.log"), "a") as log:
                log.write(os.path.join(os.path.dirname(path), self.inner.read_bytes(path).decode().strip()) + "\n")

    def open_range(self, path: str) -> RangeFile:
        self._gate("read", path)
        return self.inner.open_range(path)


def latest_history(control_dir: str) -> List[str]:
    """Every step directory ``latest`` was ever set to, in order (repeats kept)."""
    text = _read(os.path.join(control_dir, "latest.log")) or ""
    return [line for line in text.splitlines() if line]
