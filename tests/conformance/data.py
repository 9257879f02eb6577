"""The fuzzer's global batches: dicts of token ids, targets, a validity mask and route values.

``{"idx": [N, T] int64, "tgt": [N, T] int64, "mask": [N, T] bool, "route": [N] int64}``; the
target of a token is a fixed function of it (learnable in a few steps).
Rows are split over workers, then micro-batches (zeroray.engine.batch.split_batch), so part
``p = rank * accum + micro`` holds rows ``[p * rows, (p + 1) * rows)``.

- ``padded``: each row has a random number (>= 1) of valid tokens; the rest are padding.
- ``varshape``: the sequence length T changes from step to step (else one T per case).
- route values pick a Route block's expert per row. With ``unused=False`` every expert gets
  at least one row of every global batch (so each expert runs on some rank every step), or
  of every micro-batch (``cover_parts``); with ``unused=True`` some steps give one expert no
  row at all (it runs on no rank: an unused parameter in that step).
"""
from __future__ import annotations

import random
from typing import List

import torch

from tests.conformance.grammar import MAX_SEQ, ModelSpec


def make_batches(rng: random.Random, spec: ModelSpec, global_rows: int, steps: int, *, padded: bool,
                 varshape: bool, unused: bool, cover_parts: int = 1) -> List[dict]:
    """``cover_parts`` (with ``unused=False``): every expert gets a row in each of that many equal
    parts of the global batch (1: somewhere in it; workers x micro-batches: in every micro-batch)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    fixed_seq = rng.randint(2, 6)
    out = []
    for _ in range(steps):
        seq = rng.randint(2, MAX_SEQ) if varshape else fixed_seq
        idx = torch.randint(0, spec.vocab, (global_rows, seq), generator=g)
        # targets the model can learn within a few steps (a fixed map of the token), so that a step
        # moves the loss well beyond rounding (compare.py measures how far)
        tgt = (idx * 3 + 1) % spec.vocab
        if padded:
            lengths = torch.randint(1, seq + 1, (global_rows, 1), generator=g)
            mask = torch.arange(seq)[None, :] < lengths
        else:
            mask = torch.ones(global_rows, seq, dtype=torch.bool)
        cover = cover_parts if spec.routed and not unused else 0
        route = _routes(rng, spec.experts, global_rows, unused, cover)
        out.append({"idx": idx, "tgt": tgt, "mask": mask, "route": route})
    return out


def _routes(rng: random.Random, experts: int, rows: int, unused: bool, cover: int) -> torch.Tensor:
    route = [rng.randrange(experts) for _ in range(rows)]
    if unused and rng.random() < 0.5:
        gone = rng.randrange(experts)  # no row of this step goes to expert `gone`
        route = [(e + 1) % experts if e == gone else e for e in route]
    elif cover:
        # every expert gets a row in each part (a part has >= experts rows: see case.py)
        per = rows // cover
        for part in range(cover):
            for e, row in enumerate(rng.sample(range(per), experts)):
                route[part * per + row] = e
    return torch.tensor(route, dtype=torch.int64)
