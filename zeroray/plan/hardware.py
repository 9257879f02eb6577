"""The cluster a plan runs on: GPUs per node, memory, peak FLOP/s, links, host costs.

[Note: hardware presets]
Each preset holds the vendor's dense 16-bit peak and the *achieved* fraction of it that a large
transformer matmul reaches (``achieved``, a calibration input), plus ``half_tokens``: the tokens of
a micro-batch at which a GPU reaches half of ``achieved``. Efficiency then follows
``achieved · T / (T + half_tokens)`` for T tokens per micro-batch: small local batches use the matrix
units badly, which is what makes the paper's 64 -> 400 GPU scaling super-linear.

Link figures are effective bus bandwidths (what NCCL's ring reaches, about 80% of the wire):
``intra_bw`` per GPU inside a node, ``inter_bw`` per node across nodes (shared by the node's GPUs);
``launch_s`` is the host cost of launching one collective (measured: about 63 us per NCCL
collective on the H200, docs in shared/evidence), ``hbm_bw`` bounds the optimizer step.
The H200's ``achieved`` is calibrated from one plain single-GPU step of the evidence (808M bf16,
8 x 1024 tokens, 87,715 tokens/s); the H100 shares its SMs; the V100's comes from Megatron-LM's
published single-GPU 39 TFLOP/s (30% of 125) at a large batch.

CPU workers (``cores`` > 0) share the node's cores: with one thread each, ``W`` workers on ``C < W``
cores each get ``C / W`` of a core for everything they compute, copy or launch (``core_share``);
with ``W >= C`` (``saturated``) gloo's copies need the cores the compute holds, so a collective's
time, gloo's α–β measured at that world size on the same cores, is hidden beside the compute only
in the share ``busy_overlap`` and adds to the step for the rest. That share is measured
(benchmarks/plan_measure.py's ``overlap``: the plain step, a reduce-scatter, and both at once on
every rank); a cluster without the measurement takes 1, the overlap every other cluster has (the
rule that it is less was added while rows were out of bounds, so it stands only measured).
The ``cpu`` preset's figures are placeholders of this class of machine: calibrate.py's
``cpu_cluster`` builds a machine's from what benchmarks/plan_measure.py measured on it (the
engine's single-process step, the flat AdamW step, gloo's α–β, the step's copies run together, and
a tiny model's step for ``step_overhead_s``; [Note: CPU calibration]).

``straggler`` (>= 1) is how much longer a step's compute takes when every rank must wait for the
slowest: the ranks of a data-parallel step meet at its collectives, so the step moves at the pace
of the slowest rank, not of a typical one. On dedicated GPUs the ranks' times barely differ (1).
CPU workers that share a machine's cores do not run alike: the OS schedules them unevenly, and
one of them is behind at every collective (the engine's comm_report shows one rank waiting tens
of milliseconds on its peers at every step). It is measured, not fitted: the median over steps of
the slowest of one copy per worker (where the workers outnumber the cores; else one per core) of
the single-process step started together, over the median of all of their steps
(benchmarks/plan_measure.py's ``contended_floor``). A single worker waits for no one and does not
pay it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    memory_bytes: float          # per GPU (or per CPU worker)
    peak_flops: float            # dense 16-bit (fp32 for CPU)
    achieved: float              # fraction of peak reached by a large matmul (calibration)
    half_tokens: float           # micro-batch tokens at half of ``achieved``
    intra_bw: float              # bytes/s per GPU inside a node (ring bus bandwidth)
    intra_lat: float             # seconds per ring hop inside a node
    inter_bw: float              # bytes/s per node between nodes
    inter_lat: float             # seconds per ring hop between nodes
    launch_s: float              # host seconds per collective launch
    hbm_bw: float                # bytes/s of the memory the optimizer step streams
    fp32_ratio: float = 0.5      # fp32 matmul speed relative to the 16-bit peak (TF32 on Ampere+)
    cores: float = 0.0           # CPU cores a node's workers share (CPU workers); 0: a device per worker
    step_overhead_s: float = 0.0  # host seconds per step outside the replay (runtime call, status), measured
    straggler: float = 1.0       # the slowest rank's compute over a typical rank's, measured (>= 1)
    context_bytes: float = 1e9   # taken before training: the CUDA context and workspaces ([Note: peak memory])
    host_bw: float = 50e9        # bytes/s each way between a GPU and host memory (offload="cpu", on paper)
    disk_bw: float = 2e9         # bytes/s of a worker's disk tier, reads and writes together (offload="disk")
    busy_overlap: float = 1.0    # CPU workers with every core busy: the share of a collective hidden beside compute

    def __post_init__(self) -> None:
        for name in ("gpus_per_node",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r} is invalid: it must be an integer >= 1")
        for name in ("memory_bytes", "peak_flops", "achieved", "intra_bw", "inter_bw", "hbm_bw", "host_bw", "disk_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r} is invalid: it must be > 0")
        if not self.context_bytes >= 0:
            raise ValueError(f"Cluster.context_bytes={self.context_bytes!r} is invalid: it must be >= 0")
        if not 0.0 <= self.busy_overlap <= 1.0:
            raise ValueError(f"Cluster.busy_overlap={self.busy_overlap!r} is invalid: it is a share, between 0 and 1")
        if not self.straggler >= 1.0:
            raise ValueError(f"Cluster.straggler={self.straggler!r} is invalid: it is the slowest rank's compute "
                             "time over a typical rank's, at least 1 (1: ranks that run alike)")

    def efficiency(self, tokens: float) -> float:
        """Fraction of peak reached by a micro-batch of ``tokens`` tokens; see [Note: hardware presets]."""
        return self.achieved * tokens / (tokens + self.half_tokens)

    def core_share(self, workers_on_node: int) -> float:
        """How many workers share one core: ``workers / cores`` when they outnumber the node's
        cores (CPU workers, one thread each), else 1; see [Note: hardware presets]."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, workers_on_node / self.cores)

    def saturated(self, workers_on_node: int) -> bool:
        """CPU workers that keep every core of the node busy: nothing is left to run a collective's
        copies beside the compute (gloo over loopback TCP is the cores' own work)."""
        return self.cores > 0 and workers_on_node >= self.cores

    def with_(self, **changes: Any) -> "Cluster":
        return replace(self, **changes)


GPU_PRESETS: Dict[str, Cluster] = {
    # 8 x H100 SXM per node, NVLink 4 (450 GB/s per direction), 8 x 400 Gb/s NICs per node.
    "h100": Cluster("h100", 8, 80 * GB, 989e12, 0.495, 512, 360 * GB, 8e-6, 320 * GB, 20e-6, 63e-6, 3.35e12 * 0.8),
    # H200: the H100's SMs with 141 GB of faster HBM.
    "h200": Cluster("h200", 8, 141 * GB, 989e12, 0.495, 512, 360 * GB, 8e-6, 320 * GB, 20e-6, 63e-6, 4.8e12 * 0.8),
    # DGX-2 as in the ZeRO paper: 16 x V100 32 GB on NVSwitch, 800 Gb/s between nodes; PCIe 3 to the host.
    "v100-32gb": Cluster("v100-32gb", 16, 32 * GB, 125e12, 0.32, 512, 120 * GB, 10e-6, 80 * GB, 30e-6, 30e-6,
                         0.9e12 * 0.8, fp32_ratio=0.125, host_bw=12 * GB),
    # A GPU whose name matches no preset ([Note: unknown GPU]): its memory is read from the device; its
    # speed is assumed low and its links PCIe-class, so that communication weighs heavily.
    "unknown-gpu": Cluster("unknown-gpu", 8, 16 * GB, 100e12, 0.4, 512, 20 * GB, 10e-6, 10 * GB, 30e-6, 63e-6,
                           1.0e12 * 0.8, host_bw=12 * GB),
    # A CPU worker over gloo (numbers of this class of machine; calibrate with benchmarks/plan_check.py). Its
    # context is the worker process's baseline: Python, torch and Ray, about 0.32 GB measured by fits.py
    # (benchmarks/README.md, "The largest model that fits").
    "cpu": Cluster("cpu", 1, 8 * GB, 50e9, 1.0, 1, 1 * GB, 50e-6, 1 * GB, 50e-6, 100e-6, 10 * GB, fp32_ratio=1.0,
                   cores=1.0, context_bytes=0.32 * GB, disk_bw=4 * GB),
}


# [Note: unknown GPU]
# stage="auto" reads a GPU's memory from the device and takes its speed from a preset only when the
# device's name says it is that GPU: an H100 in its SXM form (the PCIe and NVL forms are slower and
# their names say so), an H200, or a V100 (the preset's speed, with the device's own memory: a 16 GB
# V100 is not taken for the 32 GB one). Anything else gets "unknown-gpu": a modest peak and
# PCIe-class links, under which a stage that communicates more must gain more to be chosen, so the
# choice leans to the lower, simpler stage; memory is exact either way. The log says which.
NAME_PRESETS = ((("H200",), "h200"), (("H100", "HBM3"), "h100"), (("H100", "SXM"), "h100"), (("V100",), "v100-32gb"))


def preset_for_device(name: str) -> Optional[str]:
    """The preset whose speed a GPU called ``name`` (``torch.cuda.get_device_properties(i).name``) has,
    or None; see [Note: unknown GPU]."""
    upper = name.upper()
    return next((preset for words, preset in NAME_PRESETS if all(w in upper for w in words)), None)


def cluster_preset(name: str, **changes: Any) -> Cluster:
    """A preset of [Note: hardware presets], with fields replaced by ``changes``."""
    key = name.lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"gpu={name!r} is not a known preset: choose one of {', '.join(GPU_PRESETS)}, or build a "
                         "zeroray.plan.Cluster(...) with your hardware's figures")
    return replace(GPU_PRESETS[key], **changes)
