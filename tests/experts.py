"""A two-expert model whose rows pick an expert by a data column, and a head it never uses:
the parameters a step does not use differ from step to step and from rank to rank."""
import torch
import torch.nn as nn

from tests.models import DIM, SEQ, VOCAB, make_batches

NEITHER = 2  # route value of a row that takes no expert


class ExpertsNet(nn.Module):
    """Row i takes expert ``idx[i, 0] % 3`` (2: none); ``unused_head`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.unused_head = nn.Linear(DIM, VOCAB)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        route = idx[:, 0] % 3
        out = x
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():  # a data-dependent branch: no rows, no use of this expert
                out = out.index_add(0, rows, torch.tanh(expert(x[rows])))
        return self.head(self.norm(out))


def experts_model() -> nn.Module:
    return ExpertsNet()


# Per step, the expert each rank's rows take (rank r: PLAN[step][r % 2]): both experts split
# between the ranks, neither, only expert 0, only expert 1, ...
PLAN = [(0, 1), (NEITHER, NEITHER), (0, 0), (1, 0), (NEITHER, NEITHER), (1, 1), (0, 1), (1, NEITHER)]


def expert_batches(steps: int, world: int, batch: int = 12, plan=PLAN):
    """Global batches whose rows of rank r (the harness's even split) route by ``plan``."""
    out = []
    rows = batch // world
    for step, (idx, tgt) in enumerate(make_batches(steps, batch=batch)):
        idx = idx.clone()
        for r in range(world):
            choice = plan[step % len(plan)][r % 2]
            idx[r * rows:(r + 1) * rows, 0] = choice
        out.append((idx, tgt))
    return out
