"""Models and data shared by the parity tests: every awkward case the engine must handle.

ParityNet has tied weights (embedding shared with the output layer), a module called twice
in one forward, a frozen parameter, a registered buffer, and parameter sizes that do not
divide by 2, 3 or 4 workers.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ = 13, 7, 5


class ParityNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.shared = nn.Linear(DIM, DIM)            # called twice per forward
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.weight.requires_grad_(False)     # frozen weight, trainable bias
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight           # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = torch.tanh(self.shared(x))
        x = torch.tanh(self.shared(x)) * self.scale + x
        x = self.frozen(x)
        return self.head(self.norm(x))


class BranchNet(ParityNet):
    """A data-dependent branch: every other forward takes an extra module (same on all ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = torch.tanh(self.shared(self.emb(idx)))
        if self.calls % 3 == 0:
            x = x + torch.tanh(self.extra(x))
        return self.head(self.norm(self.frozen(x)))


def parity_model() -> nn.Module:
    return ParityNet()


def branch_model() -> nn.Module:
    return BranchNet()


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    idx, tgt = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tgt.reshape(-1))


def make_batches(steps: int, batch: int = 12, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        tgt = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((idx, tgt))
    return out


def reference_run(model_fn, loss_fn, make_optimizer, batches, seed=0, max_grad_norm=None, scheduler=None,
                  accum=1):
    """Plain single-process PyTorch training on the same global batches. A parameter no
    backward of a step reached keeps ``.grad`` None and the optimizer skips it (zeroray too)."""
    torch.manual_seed(seed)
    model = model_fn()
    opt = make_optimizer(model)
    sched = scheduler(opt) if scheduler else None
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        n = batch[0].shape[0] // accum
        total = 0.0
        for i in range(accum):
            mb = tuple(t[i * n:(i + 1) * n] for t in batch)
            loss = loss_fn(model, mb)
            (loss / accum).backward()
            total += loss.item() / accum
        params = [p for p in model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
        norms.append(float(norm))
        opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


class DivergentNet(nn.Module):
    """Runs module `a` or `b` depending on the batch: ranks given different data run different
    modules, which stage 3 cannot allow (the workers would issue different collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = self.a(x) if int(idx[0, 0]) % 2 == 0 else self.b(x)
        return self.head(x)


def divergent_model() -> nn.Module:
    return DivergentNet()


class RoutedNet(nn.Module):
    """Mixture-of-experts style routing: each worker's batch picks experts from a ModuleList
    (each expert is a unit of its own under the default wrap policy), by its first token."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(experts))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        first = int(idx[0, 0])
        for e, expert in enumerate(self.experts):
            if (first >> e) & 1:  # the token's bits choose the experts, in order
                x = x + expert(x)
        return self.head(x)


def routed_model() -> nn.Module:
    return RoutedNet()


def divergent_batches(steps: int = 2, agree_first: int = 0, world: int = 2, batch: int = 4):
    """Each worker's share starts with its own routing token (rank r: token r + 1, so neighbours
    take different branches), except the first ``agree_first`` steps, where every share starts with 2."""
    out = []
    rows = batch // world
    for step, (idx, tgt) in enumerate(make_batches(steps, batch=batch)):
        idx = idx.clone()
        for r in range(world):
            idx[r * rows, 0] = 2 if step < agree_first else r + 1
        out.append((idx, tgt))
    return out


def divergent_accum_batches(steps: int, world: int, agree_first: int = 2):
    """Two micro-batches per worker share (grad_accum_steps=2), each routing on its own token,
    different per rank and per micro-batch after the first ``agree_first`` steps."""
    out = []
    for step, (idx, tgt) in enumerate(make_batches(steps, batch=4 * world)):
        idx = idx.clone()
        for r in range(world):
            for m in range(2):
                idx[r * 4 + m * 2, 0] = 2 if step < agree_first else r + m + 1
        out.append((idx, tgt))
    return out


def per_shard_loss(loss_fn, parts: int):
    """The reference loss for data-dependent models: each worker's share (or micro-batch: parts =
    workers x micro-batches) routes on its own data, and the global loss is the mean of the
    parts' losses (what zeroray computes)."""
    def loss(model, batch):
        idx, tgt = batch
        n = idx.shape[0] // parts
        return sum(loss_fn(model, (idx[r * n:(r + 1) * n], tgt[r * n:(r + 1) * n])) for r in range(parts)) / parts
    return loss
