"""Stage 3's unit buffers on CPU: anonymous mappings of the engine's own, reused gather after gather.

[Note: unit pool]
Stage 3 gathers each unit's full buffer before its use and frees it after, several times a
step ([Note: storage resize] in fetch/unit.py). Left to glibc, those buffers came from the
heap wherever a free block or the heap's top could hold them: between the activations, where
a freed unit leaves a hole the activations around it keep resident. Fixing glibc's mmap
threshold low around their allocation (``MappedBlocks``) did not stop that (glibc maps a block
only when the heap cannot serve it; most unit buffers were still cut from the heap's top), and
to keep the holes down it fixed the threshold for everything else at 8 MiB, so a model's
largest activations became mappings of their own too, faulted in afresh, kernel-zeroed, every
time they were allocated: on transformers' GPT-2 at d 512, whose MLP activations are 8 MiB
each, 150,000 faults and 15% of a stage-3 step (benchmarks/README.md has the figures).

So on CPU a stage-3 unit's memory is a mapping the pool makes itself (``mmap``), never part of
the heap, and a freed unit's mapping is kept for the next gather of a unit of the same size
instead of being handed back: once steps follow the prefetch trace (from the second step on), a
model of equal blocks maps and faults nothing new in its gathers, and the heap holds what it holds
at stages 0-2 (activations, gradients, temporaries), under the same allocator
settings (``fix_heap_ceiling`` in memory/process.py). The pool never holds more, in units and
idle together, than the most unit bytes ever in use at once (the gathered window the RSS
breakdown already counts): past that it hands its oldest idle mappings back to the OS. So a
model whose units all differ in size keeps no more resident than that window (its gathers then
map afresh, as before the pool), and one made of equal blocks reuses the same few mappings step
after step. The pool reports its idle bytes (``idle_bytes``) for the RSS breakdown.

The memory moves in and out of the unit's own storage with ``_swap_data_ptr_``: the storage
object stays, so every view of it (the parameters, the views autograd saved) stays valid, as
with ``resize_``. A storage holding pool memory is not resizable: only the pool frees it.
"""
from __future__ import annotations

import mmap
from typing import List, Tuple

import torch


def anonymous_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of a private anonymous mapping of their own (zero pages, resident only once
    written), as a storage that keeps the mapping alive: it goes when the last storage holding it
    does. Raises OSError when the process is out of mappings (``vm.max_map_count``)."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).untyped_storage()


class UnitPool:
    """Mappings for stage 3's unit buffers, by size: ``fill`` gives a 0-byte storage its memory,
    ``take_back`` takes it out again and keeps it for the next ``fill`` of that size, as long as
    what the pool holds (in units and idle) stays within the most unit bytes ever in use at once."""

    def __init__(self) -> None:
        self._idle: List[Tuple[int, torch.UntypedStorage]] = []  # (bytes, memory), oldest first
        self.idle_bytes = 0      # kept for the next gathers
        self.in_use_bytes = 0    # in units now
        self.peak_bytes = 0      # the most ever in units at once: what the pool may hold in all
        self.mappings_made = 0

    @property
    def mapped_bytes(self) -> int:
        """Every mapping the pool holds: in units or idle."""
        return self.in_use_bytes + self.idle_bytes

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` (0 bytes) ``nbytes`` of memory: the newest idle mapping of that size, or a new one."""
        assert storage.nbytes() == 0, storage.nbytes()
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i][0] == nbytes:
                memory = self._idle.pop(i)[1]
                self.idle_bytes -= nbytes
                break
        else:
            memory = anonymous_storage(nbytes)
            self.mappings_made += 1
        storage._swap_data_ptr_(memory)  # ``memory`` is left with the 0-byte storage
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self._evict()

    def take_back(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory (a ``fill``'s) and keep it; ``storage`` is left with 0 bytes."""
        nbytes = storage.nbytes()
        if not nbytes:
            return
        memory = torch.UntypedStorage(0)
        storage._swap_data_ptr_(memory)
        self.in_use_bytes -= nbytes
        self._idle.append((nbytes, memory))
        self.idle_bytes += nbytes
        self._evict()

    def release(self) -> None:
        """Hand every idle mapping back to the OS (the ones in units stay)."""
        self._idle.clear()
        self.idle_bytes = 0

    def _evict(self) -> None:
        """Hand the oldest idle mappings back until the pool holds no more than its peak in use: on a
        model whose units all differ in size nothing is reused, and nothing piles up either."""
        while self._idle and self.mapped_bytes > self.peak_bytes:
            nbytes, _ = self._idle.pop(0)
            self.idle_bytes -= nbytes
