"""Issue 17's cuts, in process: the stage 1-2 local shard in the arena's rows, segments cut at
its pieces, the sharded build's arena adopted as the stage-3 master and freed without the cyclic
collector, and the worker's compute thread and phase peaks (memory/process.py)."""
import functools
import gc
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import zeroray as zr
from examples import gpt
from zeroray.layout.arena import FlatLayout
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.engine.initial_values import adopt_kept_arena
from zeroray.layout.local_shard import LocalShard
from zeroray.engine.optim import build_segments
from zeroray.memory.process import HEAP_THRESHOLD, ProcessMemory
from zeroray.construct.sharded_init import build_sharded

CFG = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)


def _layout(world):
    with torch.device("meta"):
        return FlatLayout.from_module(gpt.GPT(CFG), world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_arena_rows_are_the_shard_in_shard_coordinates(world):
    layout = _layout(world)
    arena = torch.arange(layout.full_numel, dtype=torch.float32)
    for rank in range(world):
        rows = LocalShard.arena_rows(layout, arena, rank)
        assert rows.numel() == layout.shard_numel and len(rows.breaks()) == len(layout.units) - 1
        expected = torch.cat([arena[u.full_offset:u.full_offset + u.padded].view(world, -1)[rank]
                              for u in layout.units])
        assert torch.equal(rows.clone(), expected)
        for name in layout.param_names:  # every parameter's piece is one view into the arena
            piece, lo, hi = layout.param_shard_view(rows, name, rank)
            assert piece.numel() == hi - lo
            if hi > lo:
                assert piece.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert torch.equal(rows.read(0, layout.shard_numel), expected)  # across pieces: a copy
        with pytest.raises(IndexError, match="span two pieces"):
            rows[0:layout.shard_numel]
        rows.copy_(torch.zeros(layout.shard_numel))  # writes land in the arena
        assert all(not t.any() for t in rows.tensors())


def test_segments_never_cross_a_break_and_cover_the_shard():
    spans = [(0, 3, {}), (3, 5, {"weight_decay": 0.0}), (6, 9, {}), (12, 14, {})]
    whole = build_segments(spans, 16)
    assert [(s.start, s.end) for s in whole] == [(0, 3), (3, 6), (6, 16)]
    cut = build_segments(spans, 16, breaks=[6, 10, 12])
    assert [(s.start, s.end) for s in cut] == [(0, 3), (3, 6), (6, 10), (10, 12), (12, 16)]
    assert dict(cut[1].overrides) == {"weight_decay": 0.0} and cut[3].overrides == ()  # all padding


def test_the_sharded_build_arena_is_adopted_as_the_master():
    world, rank = 2, 1
    built = build_sharded(functools.partial(gpt.GPT, CFG), 0, world, rank)
    assert built is not None
    _, layout, kept = built
    shard = adopt_kept_arena(layout, kept, rank, torch.device("cpu"))
    assert shard is not None and shard.numel() == layout.shard_numel
    for name, (lo, hi, values) in kept.items():
        piece, lo2, hi2 = layout.param_shard_view(shard, name, rank)
        assert (lo, hi) == (lo2, hi2)
        if hi > lo:
            assert piece.data_ptr() == values.data_ptr()  # in place: nothing to copy
    for unit in layout.units:
        lo, hi = unit.rank_range(rank)
        assert not shard[unit.shard_offset + hi - lo:unit.shard_offset + unit.shard_numel].any()  # padding


def test_a_sharded_build_leaves_no_cyclic_garbage():
    model_fn = functools.partial(gpt.GPT, CFG)
    build_sharded(model_fn, 0, 2, 0)  # first build: torch's lazy imports may leave their own garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        build_sharded(model_fn, 0, 2, 0)
        gc.collect()
        tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not tensors, f"{len(tensors)} tensors freed only by the cyclic collector"


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (0, "fp32")])
def test_state_round_trip_through_the_local_shard(stage, dtype):
    def engine():
        return Engine(functools.partial(gpt.GPT, CFG), gpt.gpt_loss, zr.AdamW(lr=1e-2),
                      zr.ZeroConfig(stage=stage, dtype=dtype), SoloGroup(), seed=1)

    batches = list(gpt.CharBatches(4, CFG.seq_len, 4, seed=3))
    a = engine()
    if stage in (1, 2) and dtype == "fp32":  # the master is the arena's rows: no tensor of its own
        assert a.master is a.param_shard and a.master.breaks()
        assert a.master.tensors()[0].untyped_storage().data_ptr() == a.units.arena.untyped_storage().data_ptr()
    for batch in batches[:2]:
        a.train_step(batch)
    tensors, scalars = a.export_state()
    b = engine()
    b.import_state(tensors, scalars)
    for batch in batches[2:]:
        la, lb = a.train_step(batch).loss, b.train_step(batch).loss
        assert la == lb
    assert torch.equal(a.master_shard(), b.master_shard())
    for name, p in a.model.named_parameters():  # the gathered parameters follow the master
        if stage < 3:
            assert torch.equal(p.detach(), dict(b.model.named_parameters())[name].detach())
    a.close()
    b.close()


def test_process_memory_runs_engine_work_on_one_thread():
    """Every step on one thread, whichever thread calls; construction on another of its own
    ([Note: construction's arena] in memory/process.py)."""
    memory = ProcessMemory(mmap_threshold=None)  # this test process's allocator stays as it is
    seen, built_on = set(), set()

    def build(x):
        built_on.add(threading.get_ident())
        return x + 1

    def work(x):
        seen.add(threading.get_ident())
        return x + 1

    assert memory.build(build, 1) == 2
    callers = [threading.Thread(target=lambda: memory.step(work, 0)) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert memory.build(build, 2) == 3  # a second build (a rebuilt engine) on construction's thread again
    assert len(seen) == 1 and threading.get_ident() not in seen
    assert len(built_on) == 1 and not built_on & seen and threading.get_ident() not in built_on

    def fails():
        raise ValueError("step failed")

    with pytest.raises(ValueError, match="step failed"):  # the error's own type reaches the caller
        memory.step(fails)
    report = memory.report()
    # The kernel's RSS counters are per-CPU approximations: compare within a page or two of slack.
    assert all(report[k] > 0 for k in ("baseline_rss", "construction_peak_rss", "after_construction_rss",
                                        "step_peak_rss", "rss", "peak_rss_bytes"))
    assert report["peak_rss_bytes"] >= report["construction_peak_rss"]
    memory.close()


def _run_each(script, modes):
    """{mode: the JSON ``script`` prints} for each mode, each in a fresh process (its own allocator)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    grew = {}
    for mode in modes:
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                             check=True, timeout=120)
        grew[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return grew


# Construction's pattern in miniature (the sharded build: blocks made, some kept, the rest freed),
# then a step that allocates blocks of the freed ones' size, under the allocator settings the
# engine fixes on CPU (1 MiB blocks are the heap's). The script prints how many of the step's
# blocks were cut from the holes construction left.
_CONSTRUCTION_HOLES = """
import json, torch
from zeroray.memory.process import ProcessMemory, fix_heap_ceiling
fix_heap_ceiling()
memory = ProcessMemory()
kept = []
def build():
    blocks = [torch.ones(2**18) for _ in range(64)]  # 1 MiB each
    kept.extend(blocks[1::2])  # the holes lie between kept blocks: they do not merge into the top
    return [b.data_ptr() for b in blocks[0::2]]
holes = memory.build(build)
def step():
    blocks = [torch.ones(2**17) for _ in range(32)]  # 512 KiB (an aligned block of a hole's own size needs more)
    return [b.data_ptr() for b in blocks]
print(json.dumps(sum(any(h <= p < h + 2**20 for h in holes) for p in memory.step(step))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_steps_never_cut_their_blocks_from_what_construction_freed():
    """[Note: construction's arena] in memory/process.py: construction runs in an arena of its own,
    so the steps' transients never land in the holes construction left (which the trim after it
    made non-resident: each block cut from one is pages the steps had not touched). When both ran
    on the compute thread, 19 of the step's 32 blocks were cut from construction's holes."""
    reused = _run_each(_CONSTRUCTION_HOLES, ("run",))["run"]
    assert reused == 0, reused


# A step's pattern in miniature: a large block freed first (glibc raises its mmap threshold to
# it), then blocks below that size kept and dropped in turn, as activations and temporaries are.
_HOLES = """
import json, sys, torch
from zeroray.memory.process import ProcessMemory, current_rss_bytes
memory = ProcessMemory(mmap_threshold=None if sys.argv[1] == "dynamic" else 1 << 20)
def step():
    del_me = torch.ones(2**23)  # 32 MiB
    del del_me
    before, kept = current_rss_bytes(), []
    for i in range(40):
        t = torch.ones(2**21)  # 8 MiB
        if i % 2:
            kept.append(t)
    return current_rss_bytes() - before, sum(t.numel() * t.element_size() for t in kept)
print(json.dumps(memory.step(step)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_fixed_mmap_threshold_returns_freed_blocks():
    """[Note: process memory]: with glibc's own threshold the freed 8 MiB blocks stay resident as
    holes between the kept ones; with the threshold fixed they go back to the OS, and the RSS
    grows by the kept bytes only."""
    grew = _run_each(_HOLES, ("dynamic", "fixed"))
    (dynamic, kept), (fixed, _) = grew["dynamic"], grew["fixed"]
    assert kept == 20 * 2**23
    assert fixed < kept + 16 * 2**20, grew
    assert dynamic > kept + 64 * 2**20, grew  # the control: glibc's default keeps the holes


# Stage 3's pattern: the blocks of _HOLES allocated inside MappedBlocks.mapped() (as Units.alloc
# allocates a unit's buffer) or outside it (as activations are). glibc's mallinfo2 says how many
# bytes are in mappings of their own (hblkhd), so where each kept block came from is read off the
# allocator itself: whether the heap reuses the freed holes varies from run to run, so the RSS
# alone cannot tell the heap's blocks from mapped ones.
_MAPPED = """
import contextlib, ctypes, json, sys, torch
from zeroray.memory.process import HEAP_THRESHOLD, MappedBlocks, current_rss_bytes
class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
blocks = MappedBlocks()
n = HEAP_THRESHOLD // 8  # float32 blocks of half the threshold: the heap's, outside mapped()
ctx = blocks.mapped if sys.argv[1] == "inside" else contextlib.nullcontext
def step():
    del_me = torch.ones(2**23)  # 32 MiB
    del del_me
    before, mapped_before, kept = current_rss_bytes(), mallinfo2().hblkhd, []
    for i in range(40):
        with ctx():
            t = torch.ones(n)
        if i % 2:
            kept.append(t)
    return (blocks.active, current_rss_bytes() - before, mallinfo2().hblkhd - mapped_before,
            sum(t.numel() * t.element_size() for t in kept))
print(json.dumps(step()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_mapped_blocks_return_only_unit_buffers_to_the_os():
    """[Note: process memory]: blocks allocated inside ``mapped()`` (stage-3 unit buffers) are
    mappings of their own and go back to the OS when freed, so the RSS grows by the kept bytes
    only; blocks allocated outside it (activations) come from the heap, as with glibc's raised
    threshold, so the steps do not fault them in afresh."""
    grew = _run_each(_MAPPED, ("inside", "outside"))
    (active, inside, inside_mapped, kept), (_, _, outside_mapped, _) = grew["inside"], grew["outside"]
    assert active and kept == 20 * HEAP_THRESHOLD // 2
    assert inside_mapped >= kept, grew  # every kept block is a mapping of its own
    assert inside < kept + 4 * HEAP_THRESHOLD // 2, grew  # and the freed ones went back to the OS
    assert outside_mapped < HEAP_THRESHOLD // 2, grew  # outside mapped(), none is: the heap serves them


# A stage-3 step on a model of nn.MultiheadAttention blocks (whose backward frees its activations
# at the top of the heap), in a process of its own (the allocator settings are process-wide), with
# a batch whose MLP activations (48 x 128 x 512 fp32: 12.6 MB, 3,072 pages each) are above the 8 MiB
# mmap threshold stage 3 used to fix. After the first steps a step faults neither its activations
# nor its unit buffers in again (the pool keeps their mappings). Before MappedBlocks fixed the trim
# threshold, at 24 sequences: medians of 10690 and 13423 faults a step (units: 1226 pages). With it
# and the 8 MiB threshold, at 48, steps 3-8 faulted 19,972-76,791 pages (the activations mapped
# afresh each step); with the pool, in three runs, 0-6,658, the median of the six 2-2,064.
_STAGE3_FAULTS = """
import json, resource, torch
import torch.nn as nn
import zeroray as zr
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
torch.set_num_threads(1)
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(128), nn.LayerNorm(128)
        self.attn = nn.MultiheadAttention(128, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))
def model():
    return nn.Sequential(nn.Embedding(256, 128), *[Block() for _ in range(6)], nn.LayerNorm(128), nn.Linear(128, 256))
def loss_fn(m, batch):
    x, y = batch
    return nn.functional.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))
engine = Engine(model, loss_fn, zr.AdamW(lr=1e-3), zr.ZeroConfig(stage=3), SoloGroup(), seed=0)
x = torch.randint(0, 256, (48, 129), generator=torch.Generator().manual_seed(0))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.train_step((x[:, :-1], x[:, 1:]))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([faults, sum(u.nbytes for u in engine.units) // 4096]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_stage3_steps_fault_neither_activations_nor_unit_buffers_in_again():
    """[Note: unit pool]: stage 3's unit buffers are the pool's mappings, reused step after step,
    and the heap keeps a step's freed activations for the next, as at stages 0-2."""
    faults, unit_pages = _run_each(_STAGE3_FAULTS, ("run",))["run"]
    assert sorted(faults[2:])[3] < 4096, (faults, unit_pages)  # the (upper) median of steps 3-8


# A stage-0 step on the model of _STAGE3_FAULTS, built and stepped on the compute thread of a
# ProcessMemory (as a worker runs its engine: a thread's malloc arena, made of heaps of at most
# 64 MiB), with a batch whose activations need more than one heap. With glibc's dynamic
# thresholds the arena deleted the extra heap at the end of each backward (or trimmed its top)
# and the next step faulted it in again: here steps 3-6 faulted 3,840-11,500 pages in most steps
# (sorted, the second of the four 4,609 in each of four runs); with the thresholds fixed at the
# ceiling (fix_heap_ceiling, called by the engine's storage at stages 0-2) 0-2 in most steps.
_STAGE0_FAULTS = _STAGE3_FAULTS.split("engine = Engine")[0] + """
from zeroray.memory.process import ProcessMemory
memory = ProcessMemory()
engine = memory.build(Engine, model, loss_fn, zr.AdamW(lr=1e-3), zr.ZeroConfig(stage=0), SoloGroup(), seed=0)
x = torch.randint(0, 256, (48, 129), generator=torch.Generator().manual_seed(0))
def step():
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    engine.train_step((x[:, :-1], x[:, 1:]))
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
print(json.dumps([memory.step(step) for _ in range(6)]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_stage0_steps_on_the_compute_thread_keep_their_activations():
    """[Note: process memory]: at stages 0-2 the heap keeps a step's freed activations for the
    next step, on the worker's compute thread too (a thread arena of 64 MiB heaps)."""
    faults = _run_each(_STAGE0_FAULTS, ("run",))["run"]
    assert sorted(faults[2:])[1] < 1024, faults  # 48 x 128 x 128 fp32 activations: 1,536 pages each
