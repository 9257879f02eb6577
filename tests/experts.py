"""A two-expert model whose rows pick an expert by a data column, and a head it never uses:
which parameters a step leaves unused differs from step to step, rank to rank and
micro-batch to micro-batch (tests/dist/test_unused_params.py)."""
import torch
import torch.nn as nn

from tests.models import DIM, VOCAB, make_batches

NEITHER = 2  # the route of a row that takes no expert


class ExpertsNet(nn.Module):
    """Row i takes expert ``idx[i, 0] % 3`` (2: none); ``unused_head`` is never called;
    ``zero_gate`` is used with an all-zero gradient (used all the same, as in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.unused_head = nn.Linear(DIM, VOCAB)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.zero_gate = nn.Parameter(torch.ones(DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        route = idx[:, 0] % 3
        out = x
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():  # data-dependent: a batch with no row for this expert does not use it
                out = out.index_add(0, rows, torch.tanh(expert(x[rows])))
        return self.head(self.norm(out + 0.0 * self.zero_gate))


def experts_model() -> nn.Module:
    return ExpertsNet()


# Per step, the route of each part of the global batch (part q, counted over workers x
# micro-batches in the order the engine splits them, takes entry q % len): both experts
# split between the parts; neither; expert 0 everywhere; expert 1 in the first part only
# (worker 0's first micro-batch) and neither elsewhere; expert 1 in every other part; both.
PLAN = [(0, 1), (NEITHER,), (0,), (1, NEITHER, NEITHER, NEITHER), (NEITHER, 1), (0, 1)]


def expert_batches(steps: int, parts: int, batch: int = 12, plan=PLAN):
    """Global batches whose ``parts`` equal parts (workers x micro-batches) route by ``plan``."""
    out = []
    rows = batch // parts
    for step, (idx, tgt) in enumerate(make_batches(steps, batch=batch)):
        idx = idx.clone()
        routes = plan[step % len(plan)]
        for q in range(parts):
            idx[q * rows:(q + 1) * rows, 0] = routes[q % len(routes)]
        out.append((idx, tgt))
    return out


def unused_in(batch) -> set:
    """The parameter names a global batch leaves without a gradient (the head always)."""
    route = set((batch[0][:, 0] % 3).tolist())
    names = {"unused_head.weight", "unused_head.bias"}
    for e in range(2):
        if e not in route:
            names |= {f"experts.{e}.weight", f"experts.{e}.bias"}
    return names
