"""The step's status vector: everything the ranks must agree on at the end of a step, in one
all-reduce.

[Note: step status]
One float64 vector, all-reduced with a sum, carries [the sum of squared gradient norms; per
rank: failed, left the plan, events recorded, their digest, its summed loss; one slot per
trainable parameter (``layout.param_names`` order), where each rank adds 1 if its backward
produced a gradient for that parameter in some micro-batch of the step; the gradient
buckets' share (comm/bucket_learning.py)]. Each rank writes only its own slots (or adds its
count), so the sum hands every rank every other rank's values. Reading it is the step's one
host synchronisation: the loss travels in it rather than through a ``float(loss)`` of its
own, which on a GPU would drain the queue ahead of backward. It decides the step outcome
([Note: step outcome] in errors.py), whether the stage-3 trace is adopted, which parameters
no rank used (a sum of 0: the optimizer skips them, [Note: unused parameters] in
engine/flat_pieces.py), and what the bucket tuner learns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

PER_RANK = 5  # failed, left the plan, events, digest, loss


@dataclass(frozen=True)
class RankStatus:
    failed: bool
    exited: bool      # left the stage-3 plan (a negotiated step)
    events: float     # events recorded in its last micro-batch
    digest: float     # their digest
    loss: float       # its micro-batches' summed loss (0 if it failed)


@dataclass(frozen=True)
class StepStatus:
    norm: float                  # the global gradient norm (inf if not finite)
    ranks: List[RankStatus]
    used: List[float]            # per trainable parameter: how many ranks produced a gradient for it
    extra: List[float]           # the summed values after the parameters' slots

    @property
    def failed(self) -> List[int]:
        return [r for r, s in enumerate(self.ranks) if s.failed]

    @property
    def any_exit(self) -> bool:
        return any(s.exited for s in self.ranks)

    @property
    def agreed(self) -> bool:
        """Every rank recorded the same events (same count, same digest)."""
        return len({(s.events, s.digest) for s in self.ranks}) == 1

    def unused(self, names: Sequence[str]) -> List[str]:
        """The parameters (``names``: the order of the used slots) no rank produced a gradient for."""
        return [n for n, count in zip(names, self.used) if count == 0]


def encode(world_size: int, rank: int, sumsq: Optional[torch.Tensor], loss_sum: Optional[torch.Tensor],
           trace: Tuple[float, float, float], extra: Sequence[float], device: torch.device,
           used: Sequence[float] = ()) -> torch.Tensor:
    """This rank's vector: ``sumsq`` (None: this rank's step failed, or its norm is counted by
    another rank), ``loss_sum`` (None: failed), ``trace`` = (left the plan, events, digest),
    ``used`` = 1.0 or 0.0 per trainable parameter (the same number of them on every rank)."""
    params = 1 + PER_RANK * world_size
    vec = torch.zeros(params + len(used) + len(extra), dtype=torch.float64, device=device)
    if sumsq is not None:
        vec[0] = sumsq.double()
    mine = vec[1 + PER_RANK * rank:1 + PER_RANK * (rank + 1)]
    mine[:4] = torch.tensor([0.0 if loss_sum is not None else 1.0, *trace], dtype=torch.float64)
    if loss_sum is not None:
        mine[4] = loss_sum.double()
    if len(used) or extra:
        vec[params:] = torch.tensor([*used, *extra], dtype=torch.float64)
    return vec


def decode(values: Sequence[float], world_size: int, num_params: int = 0) -> StepStatus:
    """The all-reduced vector, read on the host (``tolist``), as every rank sees it;
    ``num_params``: the length of the ``used`` each rank encoded."""
    ranks = []
    for r in range(world_size):
        failed, exited, events, dig, loss = values[1 + PER_RANK * r:1 + PER_RANK * (r + 1)]
        ranks.append(RankStatus(bool(failed), bool(exited), events, dig, loss))
    total = values[0]
    norm = math.sqrt(total) if math.isfinite(total) else float("inf")
    params = 1 + PER_RANK * world_size
    return StepStatus(norm, ranks, list(values[params:params + num_params]), list(values[params + num_params:]))
