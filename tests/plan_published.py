"""Published figures the step simulator (zeroray.plan) is checked against, with their sources.

Each row is a ``Published``: what ``plan.simulate`` (or the planner built on it) predicts, the
published figure it is compared with, the bound, and where the figure comes from. Nothing here
is measured or fitted: tests/unit/test_plan_published.py asserts them in the suite, and
benchmarks/plan_check.py prints them beside this machine's measured rows. Sources:

- The ZeRO paper: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", SC 2020 (arXiv:1910.02054). Hardware: 400 V100 32 GB GPUs in 25
  DGX-2 nodes (16 per node on NVSwitch), 800 Gb/s between nodes; fp16 compute, fp32 master, Adam.
  Table 1's example: 7.5B parameters, 64-way data parallelism, K = 12: 120 / 31.4 / 16.6 / 1.88 GB
  at stages 0-3 (baseline, P_os, P_os+g, P_os+g+p). Plain data parallelism runs out of memory
  above 1.4B parameters on a 32 GB GPU; P_os+g trains 13B without model parallelism; ZeRO-100B
  (P_os+g with Megatron model parallelism inside a node) trains up to 170B parameters and sustains
  about 15 PFLOP/s on 400 GPUs at 100B (38 TFLOP/s per GPU); a 60B model runs super-linearly from
  64 to 400 GPUs, more than twice the 64-GPU throughput at 128.
- torchtitan's benchmark: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (end of
  2024): Llama 3.1 8B, 1D FSDP, local batch 2, selective activation checkpointing, on Grand Teton
  H100s (96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s per GPU between hosts): 5,762 tokens/s per GPU
  and 82.4 GiB at 8 GPUs (Table 1), 5,605 and 67.0 GiB at 128 (Table 3), without torch.compile.
  Its settings from torchtitan's llama3_8b.toml: seq_len 8192, AdamW, selective_ac_option 'op'.

Where zeroray departs from the paper by design, a row simulates zeroray and its reference is the
paper's figure with that departure applied in the paper's own terms (``Published.note`` says which);
a row about a run the paper made simulates the paper's system (``RunConfig.states``: "paper" for
its ZeRO, "megatron" for its plain data-parallel baseline; fp16 reductions).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List

from zeroray import plan
from zeroray.plan.planner import max_micro_batch

PHI = 7.5e9  # Table 1's parameters
GiB = 2**30

# Dense BF16 peaks (NVIDIA's H100 datasheet): SXM 989 TFLOP/s, NVL 835 (1,671 with sparsity). torchtitan's
# GPUs are "HBM2e-based SXM H100 with lower TDP [500 W], the actual peak TFLOPs number is between SXM and
# NVL, and we don't know its exact value" (its benchmark page, footnote 2): the rows take the midpoint and
# print the range.
H100_SXM_PEAK, H100_NVL_PEAK = 989e12, 835e12


@dataclass(frozen=True)
class Published:
    name: str
    predicted: float
    reference: float
    bound: float          # relative: |predicted / reference - 1| <= bound
    side: str = ""        # ">=": the reference is a floor the prediction may exceed
    unit: str = ""
    note: str = ""        # a departure by design, or what the row does not model

    @property
    def error(self) -> float:
        return self.predicted / self.reference - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.bound or (self.side == ">=" and self.predicted >= self.reference)


def gpt_shape(layers: int, hidden: int, seq: int = 1024, vocab: int = 50257) -> plan.Workload:
    """A GPT of ``layers`` blocks of width ``hidden`` (12·h² matmul parameters a block), the paper's shapes."""
    w = plan.from_params(12 * layers * hidden * hidden, seq_len=seq, vocab=vocab)
    units = (w.units[0],) + tuple(replace(w.units[1], name=f"layers.{i}", params=12 * hidden * hidden + 13 * hidden,
                                          matmul_params=12 * hidden * hidden) for i in range(layers))
    units += (replace(w.units[-1], params=2 * hidden, matmul_params=vocab * hidden),)
    return plan.Workload(f"gpt-{layers}x{hidden}", units, hidden, hidden // 128, seq, vocab, layers)


def table1_model() -> plan.Workload:
    """A GPT shape of exactly Table 1's 7.5B parameters (the embedding takes the rounding)."""
    w = plan.from_params(PHI)
    first = replace(w.units[0], params=w.units[0].params + int(PHI) - w.params)
    return plan.Workload(w.name, (first,) + w.units[1:], w.hidden, w.heads, w.seq_len, w.vocab, w.layers)


def paper_rows() -> List[Published]:
    v100 = plan.cluster_preset("v100-32gb")
    w = table1_model()
    rows = []
    # Table 1 counts P = G = 2 bytes and K = 12 per parameter. zeroray's engine keeps the reduced gradient
    # in fp32 (G = 4, the fp32 master's gradient) and its stage 1 reduce-scatters out of the buckets as
    # stage 2 does (a gradient shard where the paper's P_os keeps the full 16-bit gradient): the departures,
    # in the paper's terms, applied to its published figures.
    g_full, g_shard = PHI / 1e9, PHI / 64 / 1e9  # GB per gradient byte per parameter: whole, one shard
    departures = (
        (120.0, 120.0 + 2 * g_full, "fp32 gradient: G 2 -> 4 bytes, +2 x 7.5 GB"),
        (31.4, 31.4 - 2 * g_full + 4 * g_shard, "stage 1 holds a 4-byte gradient shard, not the full 2-byte gradient"),
        (16.6, 16.6 + 2 * g_shard, "fp32 gradient shard: G/Nd 2 -> 4 bytes"),
        (1.88, 1.88 + 2 * g_shard, "fp32 gradient shard: G/Nd 2 -> 4 bytes"),
    )
    for stage, (paper, reference, why) in enumerate(departures):
        states = plan.simulate(w, v100, plan.RunConfig(stage, 64, dtype="fp16")).memory["states"] / 1e9
        rows.append(Published(f"paper Table 1: 7.5B, 64 GPUs, stage {stage} model states GB (paper {paper:g}; "
                              f"by design {why})", states, reference, 0.02, unit=" GB",
                              note=f"against the paper's {paper:g} GB: {states / paper - 1:+.1%}"))
    largest = plan.largest_models(v100, 64, dtype="fp16", seq_len=1024, micro_batch=1, checkpointing=True,
                                  states="megatron", reduce_dtype="fp16")
    rows.append(Published("paper: largest plain-DP model on a 32 GB V100, params (the baseline's Megatron "
                          "FP16_Optimizer keeps an fp32 master gradient)", largest["0"], 1.4e9, 0.2,
                          note="Table 1's formula alone (states='paper'), without the baseline's fp32 master "
                               "gradient: " + f"{plan.largest_models(v100, 64, dtype='fp16', states='paper', reduce_dtype='fp16')['0'] / 1.4e9 - 1:+.1%}"))
    largest400 = plan.largest_models(v100, 400, dtype="fp16", seq_len=1024, micro_batch=1, checkpointing=True,
                                     states="paper", reduce_dtype="fp16")
    rows.append(Published("paper: largest P_os+g (stage 2) model without model parallelism, 400 GPUs (>= 13B)",
                          largest400["2"], 13e9, 0.2, side=">="))
    mp = plan.largest_models(v100, 400, dtype="fp16", seq_len=1024, micro_batch=1, checkpointing=True, tp=16,
                             states="paper", reduce_dtype="fp16")
    rows.append(Published("paper: largest ZeRO-100B model (stage 2, model parallel 16 in a node), 400 GPUs",
                          mp["2"], 170e9, 0.2))

    def tflops(layers: int, hidden: int, gpus: int):
        wl = gpt_shape(layers, hidden)
        # the paper's ZeRO: fp16 gradients, reduced in fp16; the micro-batch the largest that fits
        cfg = plan.RunConfig(2, gpus, dtype="fp16", tp=16, checkpointing=True, reduce_dtype="fp16", states="paper")
        mb = max(max_micro_batch(wl, v100, cfg, limit=64), 1)
        r = plan.simulate(wl, v100, replace(cfg, micro_batch=mb))
        # the paper counts the recomputed forward too (Megatron-LM's convention): 8/6 of the model FLOPs
        return r.mfu * v100.peak_flops * 8 / 6 / 1e12, mb

    t100, mb100 = tflops(125, 8192, 400)
    rows.append(Published(f"paper: 100B (125x8192, MP16, stage 2) on 400 GPUs, TFLOP/s per GPU (micro-batch {mb100})",
                          t100, 38, 0.2))
    t64, mb64 = tflops(75, 8192, 64)
    t128, mb128 = tflops(75, 8192, 128)
    rows.append(Published(f"paper: 60B super-linear, 128 vs 64 GPUs aggregate throughput (micro-batch {mb64} -> "
                          f"{mb128}) (> 2)", 2 * t128 / t64, 2.0, 0.2, side=">="))
    return rows


def titan_recompute(w: plan.Workload, cfg: dict) -> float:
    """The share of the forward that torchtitan's selective (op) activation checkpointing recomputes:
    it saves every op's output "except every second mm" of a block (torchtitan/distributed/
    activation_checkpoint.py), so of a Llama block's matmuls in call order (wq, wk, wv, wo, w1, w3, w2)
    wk, wo and w3 run again in backward; attention (sdpa) is saved."""
    h, heads, kv, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    head_dim = h // heads
    recomputed = 2 * (h * kv * head_dim + h * heads * head_dim + h * inter) * w.layers  # FLOPs per token
    return recomputed / (w.flops_per_token / 3)


def torchtitan_rows() -> List[Published]:
    """Llama 3.1 8B, FSDP (stage 3), local batch 2 x 8192, selective (op) checkpointing, bf16 parameters
    and fp32 reductions (torchtitan's default mixed_precision_reduce), on 96 GB HBM2e H100s at 2.4 TB/s."""
    w = plan.model_preset("llama3-8b", seq_len=8192)
    recompute = titan_recompute(w, plan.MODEL_PRESETS["llama3-8b"])
    mid = (H100_SXM_PEAK + H100_NVL_PEAK) / 2
    h100 = plan.cluster_preset("h100", memory_bytes=96e9, hbm_bw=2.4e12 * 0.8)
    rows, peaks = [], {}
    for gpus, published in ((8, 5762), (128, 5605)):
        cfg = plan.RunConfig(3, gpus, micro_batch=2, dtype="bf16", checkpointing=False, recompute=recompute)
        bounds = [plan.simulate(w, h100.with_(peak_flops=p), cfg).tokens_per_s_per_gpu for p in (H100_NVL_PEAK, H100_SXM_PEAK)]
        r = plan.simulate(w, h100.with_(peak_flops=mid), cfg)
        peaks[gpus] = r.memory["total"]
        rows.append(Published(f"torchtitan Llama-3.1-8B FSDP {gpus} H100 tokens/s/GPU (SAC recomputes {recompute:.0%} "
                              f"of fwd; peak NVL..SXM: {bounds[0]:,.0f}..{bounds[1]:,.0f})", r.tokens_per_s_per_gpu,
                              published, 0.2))
    # The memory of one run is not a check: the footprint knows full or no activation checkpointing, not
    # torchtitan's selective one. Its activations are the same at 8 and 128 GPUs, so the difference of the
    # two is what sharding over 16x more GPUs saves: the model states.
    rows.append(Published("torchtitan Llama-3.1-8B FSDP memory at 8 less at 128 GPUs GiB (82.4 - 67.0: the sharded "
                          "states)", (peaks[8] - peaks[128]) / GiB, 82.4 - 67.0, 0.2, unit=" GiB"))
    return rows


def rows() -> List[Published]:
    return paper_rows() + torchtitan_rows()
