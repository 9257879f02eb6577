"""The stage-3 parameter shard on disk ([Note: parameter shard on disk] in
zeroray/offload/shard.py) against the same shard in memory: ranges read ahead (one unit's, or
several tiling a coalesced gather's range) and ranges read when sent hold the same values; a
write drops what was read ahead and every later read sees it; the cast of the update into bf16
is the one ``copy_`` makes; a directory too small for the file fails when it is made, and a
failed write fails the reads after it. The file is a real file in a temporary directory."""
import os

import pytest
import torch

from zeroray.layout.local_shard import LocalShard
from zeroray.offload.shard import DiskShard
from zeroray.offload.tier import OffloadError

N = 1000
UNITS = [(0, 100), (100, 350), (350, 360), (360, N)]  # slices of the shard, as units lay them out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_ahead_and_when_sent_equal_memory(tmp_path, dtype):
    values = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(dtype)
    disk, memory = DiskShard(values, str(tmp_path), 0), LocalShard.contiguous(values.clone())
    assert disk.numel() == N and disk.element_size() == values.element_size() and disk.tensors() == []
    for a, b in UNITS[:3]:
        disk.prefetch(a, b)
    assert sum(t.numel() for t in disk.tensors()) == 360  # the read-ahead buffers, until sent
    assert torch.equal(disk[0:100], memory[0:100])            # one unit's, read ahead
    assert torch.equal(disk.read(100, 360), memory.read(100, 360))  # two, tiling a coalesced range
    assert disk.tensors() == []
    assert torch.equal(disk[360:N], memory[360:N])            # never asked for: read when sent
    assert (disk.hits, disk.misses) == (2, 1)
    assert torch.equal(disk.cpu(), memory.cpu())
    disk.close()


def test_a_write_drops_the_read_ahead_and_casts_as_copy(tmp_path):
    values = torch.zeros(N, dtype=torch.bfloat16)
    disk = DiskShard(values, str(tmp_path), 0)
    disk.prefetch(0, 100)  # read before the write: stale once it is written
    update = torch.randn(300, generator=torch.Generator().manual_seed(1))  # the fp32 master's chunk
    writes = [disk.write(0, update[:150]), disk.write(150, update[150:])]
    assert disk.tensors() == []
    disk.prefetch(0, 100)  # read after the writes still pending: waits for them on the pool
    want = torch.zeros(N, dtype=torch.bfloat16)
    want[:300].copy_(update)  # the cast a publish makes
    assert torch.equal(disk[0:100], want[:100]) and torch.equal(disk.read(100, N), want[100:])
    for w in writes:
        assert w.done()
    disk.copy_(torch.ones(N))  # an import: the whole shard, cast
    assert torch.equal(disk.cpu(), torch.ones(N, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        disk.copy_(torch.ones(N + 1))
    stats = disk.stats()
    assert stats["shard_bytes_written"] == 2 * (N + 300 + N) and stats["shard_bytes_read"] > 0
    disk.close()


def test_a_full_file_system_fails_the_shard_allocation(tiny_tmpfs):
    """A 64 KiB tmpfs: the shard's file is allocated in full when it is made, so a directory that
    cannot hold it fails there, saying what it is."""
    with pytest.raises(OffloadError, match=r"is full .* while allocating 0.1 MiB of the stage-3 parameter shard"):
        DiskShard(torch.zeros(2**16, dtype=torch.bfloat16), str(tiny_tmpfs), 0)
    assert os.listdir(tiny_tmpfs) == []


def test_a_failed_write_fails_the_next_read(tmp_path):
    """A write that fails (ENOSPC from /dev/full) is not lost: the gather's read after it raises
    the tier's error, and so does every later one."""
    disk = DiskShard(torch.zeros(N, dtype=torch.bfloat16), str(tmp_path), 0)
    os.close(disk.files.fds["params"])
    disk.files.fds["params"] = os.open("/dev/full", os.O_RDWR)
    disk.write(0, torch.ones(10))
    for _ in range(2):
        with pytest.raises(OffloadError, match="is full .*No space left on device"):
            disk.read(0, 10)
    disk.files.close()
