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
instead of being handed back: gathers fault nothing after the first step, and the heap holds
what it holds at stages 0-2 (activations, gradients, temporaries), under the same allocator
settings (``fix_heap_ceiling`` in memory/process.py). What the pool keeps idle is at most the
most unit bytes of one size ever held at once (a mapping is made only when none of that size is
idle), so a step's peak holds at most that window's worth more than the units in use; the pool
reports its idle bytes (``idle_bytes``) for the RSS breakdown.

The memory moves in and out of the unit's own storage with ``_swap_data_ptr_``: the storage
object stays, so every view of it (the parameters, the views autograd saved) stays valid, as
with ``resize_``. A storage holding pool memory is not resizable: only the pool frees it.
"""
from __future__ import annotations

import mmap
from typing import Dict, List

import torch


class UnitPool:
    """Mappings for stage 3's unit buffers, by size: ``fill`` gives a 0-byte storage its memory,
    ``take_back`` takes it out again and keeps it for the next ``fill`` of that size."""

    def __init__(self) -> None:
        self._idle: Dict[int, List[torch.UntypedStorage]] = {}
        self.idle_bytes = 0      # kept for the next gathers
        self.mapped_bytes = 0    # every mapping made: idle or in a unit

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` (0 bytes) ``nbytes`` of memory: an idle mapping of that size, or a new one."""
        assert storage.nbytes() == 0, storage.nbytes()
        idle = self._idle.get(nbytes)
        if idle:
            memory = idle.pop()
            self.idle_bytes -= nbytes
        else:
            # The storage keeps the mmap object alive; the mapping goes when the last storage holding it does.
            memory = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
            self.mapped_bytes += nbytes
        storage._swap_data_ptr_(memory)  # ``memory`` is left with the 0-byte storage

    def take_back(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory (a ``fill``'s) and keep it; ``storage`` is left with 0 bytes."""
        nbytes = storage.nbytes()
        if not nbytes:
            return
        memory = torch.UntypedStorage(0)
        storage._swap_data_ptr_(memory)
        self._idle.setdefault(nbytes, []).append(memory)
        self.idle_bytes += nbytes

    def release(self) -> None:
        """Hand every idle mapping back to the OS (the ones in units stay)."""
        self.mapped_bytes -= self.idle_bytes
        self._idle.clear()
        self.idle_bytes = 0
