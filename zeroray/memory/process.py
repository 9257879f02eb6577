"""A worker process's resident memory: its peaks by phase, and the allocator hygiene that
keeps them at what the tensors need.

[Note: process memory]
On CPU a worker's memory is its resident set (RSS), and what the model states need is only
part of it; ``memory_report`` breaks the rest down ([Note: RSS breakdown] in memory/report.py).
Five things here keep the part that is not tensors small; benchmarks/README.md has what
each one measured (``benchmarks/memory_rss.py``).

- One compute thread. glibc gives each thread that allocates a malloc arena of its own and
  keeps what is freed there for that arena's next allocations. Ray runs a threaded actor's
  calls on a pool of threads, and successive steps land on different ones, so every arena
  grows to a whole step's footprint (activations, backward temporaries): two steps' worth
  resident at once. ``step`` runs the engine on one thread of its own instead, so one arena
  serves every step. (Setting ``MALLOC_ARENA_MAX`` does the same, but only in the environment
  the process starts with; ``mallopt`` is too late once the pool's threads have their arenas.)
- Construction on a thread of its own ([Note: construction's arena]).
- Stage 3's unit buffers off the heap. They are mappings of the engine's own, kept between
  gathers ([Note: unit pool] in memory/unit_pool.py), so the heap holds what it holds at stages
  0-2 and stage 3 fixes the allocator as they do (``fix_heap_ceiling``, below). Before the pool,
  ``MappedBlocks`` lowered glibc's mmap threshold around a unit's allocation (glibc maps a block
  above its threshold, returned to the OS when freed) and fixed it at ``HEAP_THRESHOLD`` (8 MiB)
  outside, with the trim threshold at ``TRIM_THRESHOLD``: left to glibc (whose threshold climbs
  to 32 MiB with the blocks freed), unit buffers gathered and freed between the activations left
  holes, and stage 3's peak stood a few hundred MB above the bytes in use. But glibc maps a block
  only when the heap cannot serve it, so most unit buffers were still cut from the top of the
  heap, and every activation of 8 MiB or more was a mapping faulted in afresh at each step
  (benchmarks/README.md has both). ``MappedBlocks`` now serves only a stage-3 parameter shard on
  disk, whose slices it maps (offload/shard.py), and the first step's optimizer state of the disk
  tier beside it ([Note: fresh state off the heap] in offload/stepper.py). Fixing the threshold low for the whole process
  did the same for memory but faulted every activation in afresh each step (kernel-zeroed
  pages): 40% slower steps on a 3M-parameter model; ``ProcessMemory`` keeps that as an option
  (``mmap_threshold``), off by default.
  Fixing the mmap threshold also stops glibc moving its *trim* threshold, which it otherwise
  keeps at twice the mmap threshold it raised: it stayed at its initial 128 KiB, every free that
  left more than that free at the top of the heap handed those pages back to the OS, and the
  next step faulted them in afresh, kernel-zeroed. So ``MappedBlocks`` fixes the trim threshold
  as well, at ``TRIM_THRESHOLD``.
- Stages 0-3 at glibc's own ceiling. Left to glibc, the two thresholds move with whatever
  the process freed last: a Ray worker's allocations before the engine (Ray's, the import's)
  leave them anywhere up to the ceiling, and from there a step's freed activations may be
  handed back to the OS at the end of backward (above the trim threshold at the top of the
  heap) or served as mappings of their own (above the mmap threshold), and faulted in afresh,
  kernel-zeroed, by the next step. Which of them a run does comes and goes from run to run:
  the ``nn.MultiheadAttention`` GPT (benchmarks/bench_models.py) at stage 0 through Ray faulted
  16 to 9,000 pages a step on rank 0, where torch's DDP of the same model, on its process's
  main thread, faulted none. The compute thread's arena adds a way of its own: it is made of
  heaps of at most 64 MiB, and a heap that a step needed beyond the first is deleted whole when
  backward has freed it (glibc does that whatever the trim threshold, where the heap before it
  has room for twice ``M_TOP_PAD``), to be mapped and faulted in again by the next step. So on
  CPU (every stage; a stage-3 shard on disk keeps ``MappedBlocks`` instead) the engine fixes
  the allocator where glibc's rule ends up on a model whose blocks reach the ceiling
  (``fix_heap_ceiling``): the mmap threshold at ``MMAP_CEILING`` (blocks below it reuse the
  heap's pages, as stages 0-2 and DDP do once the threshold has risen), the trim threshold at
  ``TRIM_THRESHOLD`` (twice that, as glibc's rule sets it), and the top pad at the same, which
  keeps a thread arena's heaps as the trim threshold keeps the main heap's top. Nothing is
  mapped that glibc's rule at its ceiling would keep in the heap, and no more is kept at the top
  of a heap than that rule keeps. benchmarks/README.md has what it measured.
- A trim after construction: the construction transient freed to the heap (the model built
  whole before it is bound to the arena, the sharded build's scratch), and the cyclic garbage
  of a first-time import, is handed back to the OS with ``gc.collect()`` and
  ``malloc_trim(0)``. Not after every step: the next step would fault the same pages in again.
- Peaks by phase. The kernel's peak RSS (VmHWM, which ``getrusage`` reports) is read at the
  end of construction and then reset (``/proc/self/clear_refs``), so the steps' own peak is
  known apart from construction's; ``report`` gives both and the lifetime peak.

Linux and glibc only; elsewhere each part does nothing and the phase peaks are None.

[Note: construction's arena]
Construction allocates and frees far more than it keeps: the sharded build makes each layer's
weights whole, keeps this rank's slices and frees the rest (1.6 GB cut from the heap and freed
for fits.py's 29-layer GPT, whose rank keeps 0.2 GB), so the arena it ran in is left with
hundreds of MB of free blocks between the blocks it kept. The trim after construction hands
their pages back to the OS, but the blocks stay in the arena's bins, and glibc serves a request
from the smallest free block that holds it: the steps' transients (activations, gradients, the
disk tier's buffers), cut from those holes instead of from memory the steps already use, spread
over pages no step touched before, and the resident set grows to the holes they touched. When
construction ran on the compute thread, that was where the steps' own arena came from. With the
stage-3 parameter shard and optimizer state on disk the worker's peak stood 50-80 MB higher at 29
layers for it (benchmarks/offload_steps.py, engine alone, fits.py's shape, peak RSS per rank:
846-913 MB in three runs, 822-835 in four with construction apart), more the more layers (about
8 and 30 MB at 6 and 14); in memory less (1333-1340 against 1310-1332 MB at 29 layers, within the
runs' spread at 6). Why the offload worker's steps found construction's holes more often than the
in-memory one's is not known. So ``build`` runs on a thread of its own (kept, so that its arena, with
construction's holes, goes to no other thread), started only once the compute thread holds an
arena of its own (glibc gives a new thread the arena of a thread that ended, or any arena once
there are eight per core), and every step runs in an arena construction never used.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import queue
import resource
import threading
from typing import Any, Callable, Dict, Optional


def current_rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """The peak RSS since the process started or since the last ``reset_peak`` (Linux: KiB units)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Restart the kernel's peak RSS count from the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


MMAP_THRESHOLD = 1 << 20  # bytes: smaller blocks (Python objects, small tensors) stay in the heap
# MappedBlocks' threshold outside mapped() (stage 3 with its parameter shard on disk): blocks this
# large (the largest activations) are mappings too. glibc's dynamic threshold climbs towards 32 MiB,
# its ceiling; fixed that high, stage 3 kept holes of the 8-32 MiB blocks it frees between unit gathers
# (benchmarks/README.md, "Any model": the sizes tried and what each kept).
HEAP_THRESHOLD = 8 << 20
MAPPED_THRESHOLD = 128 << 10  # glibc's initial threshold: a unit's buffer smaller than this stays in the heap
# The heap's trim threshold once the mmap threshold is fixed: twice glibc's 32 MiB ceiling of the
# mmap threshold, the most its dynamic rule gives (see the note: fixing the mmap threshold alone
# left it at 128 KiB).
TRIM_THRESHOLD = 64 << 20
# The mmap threshold of every stage but a stage-3 shard on disk (fix_heap_ceiling): glibc's ceiling
# of its dynamic one (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), where its rule ends up once a block
# that large was freed.
MMAP_CEILING = 32 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2


def _glibc(name: str):
    """glibc's function ``name`` (``mallopt``, ``malloc_trim``), or None where it is not there
    (the allocator then stays as it is)."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``nbytes`` or more from mappings of their own, returned to the OS
    when freed, for the rest of the process; see [Note: process memory]. False where glibc's
    ``mallopt`` is not there (the allocator then stays as it is)."""
    mallopt = _glibc("mallopt")
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1)


class MappedBlocks:
    """A stage-3 parameter shard on disk's slices as mappings of their own ([Note: process
    memory]): what is allocated inside ``mapped()`` goes back to the OS when freed; outside it, blocks under
    ``HEAP_THRESHOLD`` come from the heap. Process-wide, like the allocator it
    tunes; does nothing where glibc's ``mallopt`` is not there (then ``active`` is False)."""

    def __init__(self) -> None:
        self._depth = 0  # mapped() contexts open (they nest: a shard's buffer inside a chunk's step)
        mallopt = _glibc("mallopt")
        # Fixing the threshold also stops glibc raising it: it stays where mapped() puts it back.
        self._mallopt = mallopt if mallopt is not None and mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD) == 1 else None
        if self._mallopt is not None:
            # ...and stops glibc raising the trim threshold with it: fixed too, see the note.
            self._mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)

    @property
    def active(self) -> bool:
        return self._mallopt is not None

    @contextlib.contextmanager
    def mapped(self):
        """Within: blocks of ``MAPPED_THRESHOLD`` or more are mappings of their own. Nested, the
        threshold goes back to ``HEAP_THRESHOLD`` when the outermost ends, not the innermost."""
        if self._mallopt is None:
            yield
            return
        self._depth += 1
        if self._depth == 1:
            self._mallopt(_M_MMAP_THRESHOLD, MAPPED_THRESHOLD)
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD)


def fix_heap_ceiling() -> bool:
    """On CPU (every stage, but a stage-3 shard on disk): fix glibc's mmap and trim thresholds
    where its own rule tops out (``MMAP_CEILING``, ``TRIM_THRESHOLD``), so that a step's freed
    activations stay in the heap for the next step instead of being faulted in afresh; see [Note:
    process memory]. Process-wide; False where glibc's ``mallopt`` is not there (the allocator then stays as it is)."""
    mallopt = _glibc("mallopt")
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, MMAP_CEILING) != 1:
        return False
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(_M_TOP_PAD, TRIM_THRESHOLD) == 1


def trim_heap() -> None:
    """Collect cyclic garbage, then hand the heap's free pages back to the OS (glibc only)."""
    gc.collect()
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def _claim_arena() -> None:
    """Allocate from the C heap on the calling thread, which makes glibc give it an arena now
    ([Note: construction's arena])."""
    bytearray(1 << 16)  # above pymalloc's 512 bytes: a malloc of the thread's own


class _ComputeThread:
    """One daemon thread that runs the calls given to it, one at a time, and returns their
    results (or raises their exceptions) in the caller's thread."""

    def __init__(self, name: str = "zeroray-compute") -> None:
        self._calls: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, args, kwargs, done, box = call
            del call
            try:
                box.append((True, fn(*args, **kwargs)))
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                box.append((False, error))
            finally:
                del fn, args, kwargs  # no reference to the call's arguments outlives it
                done.set()

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        done, box = threading.Event(), []
        self._calls.put((fn, args, kwargs, done, box))
        done.wait()
        ok, value = box.pop()
        if ok:
            return value
        raise value

    def stop(self) -> None:
        self._calls.put(None)


class ProcessMemory:
    """The worker's side of [Note: process memory]: create it before the model exists (its RSS
    then is the process baseline), build the engine with ``build`` and run steps with ``step``.
    ``mmap_threshold``: fix glibc's threshold there for the whole process (the costly option of
    [Note: process memory]); None, the default, leaves it to glibc and to ``MappedBlocks``."""

    def __init__(self, mmap_threshold: Optional[int] = None) -> None:
        self.baseline_rss = current_rss_bytes()
        # None: leave glibc's dynamic threshold alone.
        self.mmap_threshold_fixed = mmap_threshold is not None and fix_mmap_threshold(mmap_threshold)
        self.construction_peak_rss: Optional[int] = None
        self.after_construction_rss: Optional[int] = None
        self._phase_peaks = False  # the kernel's peak counts the steps only (reset after construction)
        self._compute: Optional[_ComputeThread] = None
        self._construction: Optional[_ComputeThread] = None

    def _thread(self) -> _ComputeThread:
        if self._compute is None:
            self._compute = _ComputeThread()
            self._compute.run(_claim_arena)  # its arena, before construction's thread exists
        return self._compute

    def build(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run construction ``fn(*args, **kwargs)`` on a thread of its own, not the compute
        thread ([Note: construction's arena]); record its peak, trim what it freed, and start
        counting the steps' peak."""
        self._thread()
        if self._construction is None:
            self._construction = _ComputeThread("zeroray-build")
        built = self._construction.run(fn, *args, **kwargs)
        self.construction_peak_rss = max(peak_rss_bytes(), self.construction_peak_rss or 0)
        trim_heap()
        self.after_construction_rss = current_rss_bytes()
        self._phase_peaks = reset_peak()
        return built

    def step(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one step ``fn(*args, **kwargs)`` on the compute thread."""
        return self._thread().run(fn, *args, **kwargs)

    def report(self) -> Dict[str, Optional[int]]:
        """Bytes: ``baseline_rss`` (before the model), ``construction_peak_rss``,
        ``after_construction_rss``, ``step_peak_rss`` (since construction; None when the kernel's
        peak could not be reset), ``rss`` (now) and ``peak_rss_bytes`` (the process's lifetime)."""
        now_peak = peak_rss_bytes()
        return {"baseline_rss": self.baseline_rss, "construction_peak_rss": self.construction_peak_rss,
                "after_construction_rss": self.after_construction_rss,
                "step_peak_rss": now_peak if self._phase_peaks else None, "rss": current_rss_bytes(),
                "peak_rss_bytes": max(now_peak, self.construction_peak_rss or 0)}

    def close(self) -> None:
        for thread in (self._compute, self._construction):
            if thread is not None:
                thread.stop()
        self._compute = self._construction = None
