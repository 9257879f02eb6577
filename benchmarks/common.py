"""What every benchmark row shares: the run spec, the batches, the clock and the ruler.

Every row of ``compare.py`` (the floor, the torch peers, zeroray, DeepSpeed) builds its model,
its data and its step timing from here, so the rows differ only in how they parallelise.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


BENCHMARKS = os.path.join(ROOT, "benchmarks")


def add_import_paths() -> None:
    """Make ``import gpt`` (examples/), ``import bench_models`` and ``import zeroray`` (the checkout) work."""
    for path in (BENCHMARKS, EXAMPLES, ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """One benchmark invocation: the model, the data, and how long each row trains."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256
    batch_per_worker: int = 8
    num_workers: int = 2
    threads: int = 1
    warmup_steps: int = 3
    timed_steps: int = 10
    lr: float = 1e-3
    model: str = "gpt"  # bench_models.MODELS
    # Spelled out so torch.optim.AdamW and zr.AdamW cannot drift apart (torch's default).
    weight_decay: float = 1e-2
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.timed_steps

    @property
    def global_batch(self) -> int:
        return self.num_workers * self.batch_per_worker

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def gpt_config(spec: BenchSpec):
    add_import_paths()
    from gpt import GPTConfig

    return GPTConfig(vocab_size=spec.vocab_size, seq_len=spec.seq_len, d_model=spec.d_model,
                     n_layers=spec.n_layers, n_heads=spec.n_heads)


def model_fn(spec: BenchSpec):
    """The row's ``() -> nn.Module`` (bench_models.build for ``spec.model``), picklable."""
    import functools

    add_import_paths()
    import bench_models

    return functools.partial(bench_models.build, spec.model, spec.vocab_size, spec.seq_len, spec.d_model,
                             spec.n_layers, spec.n_heads)


def build_model(spec: BenchSpec):
    """The reference initialisation: ``torch.manual_seed(seed); model_fn()``, as zr.Trainer does."""
    import torch

    torch.manual_seed(spec.seed)
    return model_fn(spec)()


def num_params(spec: BenchSpec) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in model_fn(spec)().parameters())


def global_batches(spec: BenchSpec) -> Iterator[Tuple[Any, Any]]:  # (inputs, targets)
    """The same real-text global batches (dim 0 = num_workers * batch_per_worker) in every row."""
    add_import_paths()
    from gpt import CharBatches

    return iter(CharBatches(spec.global_batch, spec.seq_len, spec.total_steps, seed=spec.seed))


def worker_slice(batch, rank: int, spec: BenchSpec):
    """Rank ``rank``'s contiguous slice of a global batch, as zr.Trainer splits it."""
    lo, hi = rank * spec.batch_per_worker, (rank + 1) * spec.batch_per_worker
    return tuple(t[lo:hi] for t in batch)


def limit_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or parallel work already ran in this process
        pass


def peak_rss_bytes() -> int:
    """Peak resident set of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass(frozen=True)
class ProcStat:
    """What /proc says of one process (or, with ``tid``, one of its threads)."""

    name: str
    state: str          # "R", "S", ... "Z" for a zombie
    minor_faults: int
    cpu_s: float        # user + system, every thread (or the one thread)


def proc_stat(pid: int, tid: Optional[int] = None) -> ProcStat:
    """/proc/<pid>/stat, or /proc/<pid>/task/<tid>/stat; FileNotFoundError once it is gone.
    The name is cut at its last ")": a process may name itself with spaces and parentheses."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        text = f.read()
    name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return ProcStat(name, fields[0], int(fields[7]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


class StepClock:
    """Wall time of each step; the first ``warmup`` steps are recorded but not summarised.

    Also the CPU time this process (all its threads) spent in the step: on a shared machine
    the wall time includes waiting for a core, the CPU time does not. It says nothing about
    work done in other processes (Ray actors), so only the in-process rows report it.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: List[float] = []
        self.cpu_times: List[float] = []
        self._t0 = self._c0 = 0.0

    def start(self) -> None:
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        dt = time.perf_counter() - self._t0
        self.cpu_times.append(time.process_time() - self._c0)
        self.times.append(dt)
        return dt

    @property
    def timed(self) -> List[float]:
        return self.times[self.warmup:]


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# [Note: bytes per worker]
# The table reports bytes *sent* by one worker in one step, under the ring algorithms the
# paper's volume formulas assume (docs/architecture.md): for N bytes of payload over W workers an
# all-reduce sends 2(W-1)/W·N, an all-gather (N = the gathered output) and a reduce-scatter
# (N = the unreduced input) each send (W-1)/W·N, a broadcast of N bytes costs the root
# (W-1)/W·N in a pipelined ring. The torch peers count the payload of every collective they
# issue and convert it with these factors; zeroray reports its own counters.
def ring_bytes_sent(collective: str, payload_bytes: int, world_size: int) -> float:
    if world_size <= 1:
        return 0.0
    share = (world_size - 1) / world_size
    return (2 * share if collective == "all_reduce" else share) * payload_bytes
