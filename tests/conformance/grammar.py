"""The fuzzer's model grammar: a random model description, the model it builds and its loss.

A ``ModelSpec`` is a frozen, printable description (what a failing case prints, so it can be
read without rerunning it). ``FuzzNet(spec)`` maps a dict batch ``{"idx", "tgt", "mask",
"route"}`` (token ids, targets, which tokens count, one routing value per row) to logits, or
to hidden states when the output layer is computed in ``loss_fn``. ``fuzz_loss`` is the
masked mean cross entropy of the rows it is given (so each worker's loss is the mean over its
own valid tokens, as under DDP), optionally plus an L2 term read over ``model.parameters()``.

Blocks, held in an ``nn.ModuleList`` (so wrap="auto" makes each block a unit of its own):
  linear   x + tanh(W x)
  twice    x + tanh(W x), twice with the same W (a module called twice)
  frozen   W x + b with W frozen; frozen_all: the whole Linear frozen
  ln       LayerNorm
  bn       BatchNorm1d over the channels (its running statistics are float buffers)
  conv     Conv1d along the sequence (kernel 3, same length)
  mha      causal self-attention (nn.MultiheadAttention)
  scale    x * scale, a (D,) float buffer in the compute (promotes a bf16 x to fp32)
  route    each row goes to the expert its ``route`` value names; an expert that no row of
           the worker's batch chose does not run there (data-dependent control flow: some
           experts run on some ranks only, and in some steps on none: an unused parameter)
  again    the first linear/twice/conv/mha block object again (one module, two names)
With ``sync_bn`` every bn block is an ``nn.SyncBatchNorm`` (normalising over the whole global
micro-batch where torch.distributed is initialised: the oracle runs BatchNorm on it).
Positions: none, or a sinusoidal table (a float buffer sliced to the sequence length).
Head: a Linear of its own ("own"), one whose weight is the embedding's ("tied"), or
``h @ model.emb.weight.t()`` in ``loss_fn`` ("loss_fn": a parameter read outside forward).
``fuzz_logits`` is what ``loss_fn`` computes its loss from (what an inference call returns).
With ``dist_loss``, ``loss_fn`` also calls torch.distributed (recipe.py's ``dist_loss``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import FrozenSet, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conformance.recipe import dist_loss

MAX_SEQ = 8       # the longest sequence any case uses (the sinusoidal table's length)
L2 = 1e-3         # the L2 term's coefficient
EMB_STD = 0.3
BLOCK_KINDS = ("linear", "twice", "frozen", "frozen_all", "ln", "bn", "conv", "mha", "scale", "route", "again")
SHAREABLE = ("linear", "twice", "conv", "mha")  # what "again" may repeat


@dataclass(frozen=True)
class ModelSpec:
    vocab: int
    dim: int
    heads: int
    blocks: Tuple[str, ...]
    experts: int
    positions: str   # "none" | "sinusoidal"
    head: str        # "own" | "tied" | "loss_fn"
    l2: bool
    sync_bn: bool = False    # bn blocks are nn.SyncBatchNorm
    dist_loss: bool = False  # loss_fn calls torch.distributed (recipe.dist_loss)

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.blocks):
            if kind not in BLOCK_KINDS:
                raise ValueError(f"block kind {kind!r} is unknown: choose from {BLOCK_KINDS}")
            if kind == "again" and not any(k in SHAREABLE for k in self.blocks[:i]):
                raise ValueError(f"block {i} is 'again' but no {SHAREABLE} block comes before it")

    def describe(self) -> str:
        extras = [f"pos={self.positions}"] if self.positions != "none" else []
        extras += [f"head={self.head}"] + (["l2"] if self.l2 else [])
        extras += (["sync_bn"] if self.sync_bn else []) + (["dist_loss"] if self.dist_loss else [])
        if "route" in self.blocks:
            extras.append(f"experts={self.experts}")
        if "mha" in self.blocks:
            extras.append(f"heads={self.heads}")
        return f"V{self.vocab} D{self.dim} [{','.join(self.blocks)}] " + " ".join(extras)

    @property
    def float_buffers_in_compute(self) -> bool:
        """Float buffers the forward reads (the sinusoidal table, the scale) or a BatchNorm's."""
        return self.positions == "sinusoidal" or "scale" in self.blocks or "bn" in self.blocks

    @property
    def routed(self) -> bool:
        return "route" in self.blocks

    def features(self) -> FrozenSet[str]:
        """Names of what the model exercises (for reports and for counting coverage)."""
        out = set(self.blocks) - {"again"}
        if "again" in self.blocks:
            out.add("shared_module")
        if self.positions == "sinusoidal":
            out.add("sinusoidal")
        out.add(f"head_{self.head}")
        if self.l2:
            out.add("l2")
        out |= {k for k in ("sync_bn", "dist_loss") if getattr(self, k)}
        return frozenset(out)


def sample_model(rng: random.Random, *, buffers: bool = True, routed: bool = True) -> ModelSpec:
    """A random ModelSpec; ``buffers=False`` leaves out every float buffer (sinusoidal table,
    scale, BatchNorm), ``routed=False`` the route block."""
    kinds = [k for k in BLOCK_KINDS
             if (buffers or k not in ("bn", "scale")) and (routed or k != "route")]
    kinds += ["route"] if routed else []  # twice as likely: data-dependent control flow finds the most
    blocks = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "again" and not any(b in SHAREABLE for b in blocks):
            kind = "linear"
        blocks.append(kind)
    heads = rng.choice((1, 2))
    dim = rng.choice((6, 8, 10)) if "mha" in blocks else rng.choice((5, 6, 7, 9))
    return ModelSpec(vocab=rng.choice((7, 11, 13)), dim=dim, heads=heads, blocks=tuple(blocks),
                     experts=rng.choice((2, 3)),
                     positions=rng.choice(("none", "sinusoidal")) if buffers else "none",
                     head=rng.choice(("own", "tied", "loss_fn")), l2=rng.random() < 0.3)


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(100.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, :dim // 2]
    return table


class Residual(nn.Module):
    """x + tanh(W x), ``calls`` times with the same W."""

    def __init__(self, dim: int, calls: int = 1) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.calls = calls

    def forward(self, x, route):
        for _ in range(self.calls):
            x = x + torch.tanh(self.lin(x))
        return x


class Frozen(nn.Module):
    def __init__(self, dim: int, whole: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.lin.weight.requires_grad_(False)
        if whole:
            self.lin.bias.requires_grad_(False)

    def forward(self, x, route):
        return self.lin(x)


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x, route):
        return self.ln(x)


class Batch(nn.Module):
    def __init__(self, dim: int, sync: bool = False) -> None:
        super().__init__()
        # eps 0.1, not 1e-5: over a micro-batch of 2 tokens a channel's variance can be ~1e-5,
        # and 1/sqrt(var + eps) then amplifies fp32 rounding in the gradients of everything
        # before the BatchNorm ~100-fold (1e-6 noise on a bias whose exact gradient is zero:
        # AdamW turns it into 1e-5 parameter differences). Capped at ~3x, noise stays noise.
        self.bn = (nn.SyncBatchNorm if sync else nn.BatchNorm1d)(dim, eps=0.1)

    def forward(self, x, route):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class Conv(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x, route):
        return x + torch.tanh(self.conv(x.transpose(1, 2)).transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, route):
        seq = x.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        return x + self.attn(x, x, x, attn_mask=causal, need_weights=False)[0]


class Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, x, route):
        return x * self.scale


class Route(nn.Module):
    """Rows go to the expert their route value names; an expert no row chose is not called."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x, route):
        out = x
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():  # data-dependent: the worker's rows decide which experts run
                out = out.index_add(0, rows, torch.tanh(expert(x[rows])))
        return out


def _block(kind: str, spec: ModelSpec) -> nn.Module:
    d = spec.dim
    if kind in ("linear", "twice"):
        return Residual(d, calls=2 if kind == "twice" else 1)
    if kind in ("frozen", "frozen_all"):
        return Frozen(d, whole=kind == "frozen_all")
    if kind == "ln":
        return Norm(d)
    if kind == "bn":
        return Batch(d, sync=spec.sync_bn)
    if kind == "conv":
        return Conv(d)
    if kind == "mha":
        return Attention(d, spec.heads)
    if kind == "scale":
        return Scale(d)
    if kind == "route":
        return Route(d, spec.experts)
    raise ValueError(f"unknown block kind {kind!r}")


class FuzzNet(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.emb = nn.Embedding(spec.vocab, spec.dim)
        # N(0, 1) rows make a tied or loss_fn head's logits ~sqrt(D): losses of 5+ that grow
        # under AdamW at lr 1e-2; smaller rows keep every case near ln(vocab) and decreasing.
        nn.init.normal_(self.emb.weight, std=EMB_STD)
        if spec.positions == "sinusoidal":
            self.register_buffer("pe", sinusoidal(MAX_SEQ, spec.dim))
        blocks = []
        for kind in spec.blocks:
            if kind == "again":
                blocks.append(next(b for b, k in zip(blocks, spec.blocks) if k in SHAREABLE))
            else:
                blocks.append(_block(kind, spec))
        self.blocks = nn.ModuleList(blocks)
        if spec.head == "own":
            self.head = nn.Linear(spec.dim, spec.vocab)
        elif spec.head == "tied":
            self.head = nn.Linear(spec.dim, spec.vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.spec.positions == "sinusoidal":
            x = x + self.pe[:idx.shape[1]]
        for block in self.blocks:
            x = block(x, route)
        return self.head(x) if self.spec.head != "loss_fn" else x


def wrap_blocks(name: str, module: nn.Module) -> bool:
    """A callable wrap policy: every block and every expert is a unit root."""
    return name.startswith("blocks.") and name.count(".") in (1, 3)


def fuzz_logits(spec: ModelSpec, model: nn.Module, batch: dict) -> torch.Tensor:
    """The logits of the given rows (with head="loss_fn", the output layer is applied here)."""
    out = model(batch["idx"], batch["route"])
    if spec.head == "loss_fn":
        out = out @ model.emb.weight.t()
    return out


def fuzz_loss(spec: ModelSpec, model: nn.Module, batch: dict) -> torch.Tensor:
    """Masked mean cross entropy over the given rows' valid tokens (+ the L2 term); with
    ``dist_loss``, after torch.distributed calls that leave it as it is."""
    loss = loss_of_logits(spec, model, fuzz_logits(spec, model, batch), batch)
    if spec.dist_loss:
        loss = dist_loss(loss)
    return loss


def loss_of_logits(spec: ModelSpec, model: nn.Module, out: torch.Tensor, batch: dict) -> torch.Tensor:
    """``fuzz_loss`` from the rows' logits ``out`` (the oracle's SyncBatchNorm cases compute the
    logits of all workers' rows in one forward, then each worker's loss from its own)."""
    ce = F.cross_entropy(out.float().reshape(-1, spec.vocab), batch["tgt"].reshape(-1), reduction="none")
    mask = batch["mask"].reshape(-1).float()
    loss = (ce * mask).sum() / mask.sum()
    if spec.l2:
        loss = loss + L2 * sum((p.float() ** 2).sum() for p in model.parameters())
    return loss
