"""One fuzz case from one seed: a model, a run configuration and the global batches.

``make_case(seed, without=...)`` draws everything from ``random.Random(seed)``, so a seed and
the same ``without`` set give the same case on any machine (the rerun command a failure
prints carries both). The model's initial weights come from ``torch.manual_seed(seed)``
before ``FuzzNet(spec)``, in the engine and in the oracle alike.

A routed case may start with steps in which every worker routes alike (``agree_first``), so
that at stage 3 the workers agree on a trace, follow it, and leave it when they diverge.
A case may also evaluate after training (``evaluate``): every worker calls the engine's
``evaluate`` on its share of one more batch (``loss_fn`` in eval mode, no gradients) and
``run(fuzz_logits, share)`` (the logits), compared with the oracle's model in eval mode.

Drawn last (so adding them changed no earlier draw of a seed), the recipe around the model
(issue 41, recipe.py): the optimizer and offload="disk" (configs.sample_recipe), and on the
model SyncBatchNorm (where it has a bn block) and torch.distributed calls in ``loss_fn``.

``without`` names features to leave out, the known gaps (GAPS) while other branches fix them:
  buffers   bf16/fp16 cases get no float buffer (sinusoidal table, scale, BatchNorm)
  unused    every expert of a Route block gets a row of every global batch (at stages 0-1 with
            accumulation: of every micro-batch)
  varshape  one sequence length for all steps of a case
  eval      no case evaluates after training
  uneven    every global batch divides over workers x micro-batches (else some gain 1 to
            W*k - 1 rows, copies of their first ones, and split as array_split cuts)
  diverge_dist  no SyncBatchNorm and no torch.distributed in ``loss_fn`` where stage 3's
            workers may run different modules (a routed model on 2-3 workers)
"""
from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional

import torch

from tests.conformance.configs import RunConfig, sample_config, sample_extras, sample_recipe, with_rows_at_least
from tests.conformance.data import make_batches
from tests.conformance.grammar import FuzzNet, ModelSpec, fuzz_logits, fuzz_loss, sample_model
from zeroray.engine.batch import split_batch

# The gaps the fuzzer was built to find (issue 24), each fixed since: the feature name, what
# failed, and what fixed it. ``without`` still leaves a feature out, to hunt for others.
GAPS = {
    "buffers": ("bf16/fp16 with a float buffer in the compute (dtype mismatch), or BatchNorm in bf16/fp16",
                "fixed: zeroray/engine/precision.py"),
    "unused": ("a parameter no rank used in a step still moves (zeroray gives it a zero gradient; PyTorch "
               "and DDP leave .grad None and the optimizer skips it); and at stages 0-1 with accumulation the "
               "gradient of a parameter a worker used in an earlier micro-batch but not in its last is lost",
               "fixed: zeroray/engine/flat_pieces.py, GradIntake.reduce_accumulated"),
    "varshape": ("batches whose row shapes change between steps are refused ('the batch structure changed')",
                 "fixed: checks removed"),
    "eval": ("no evaluation/inference calls on the engine (Engine.evaluate, Engine.run)", "fixed: zeroray/engine/inference.py"),
    "uneven": ("a global batch whose rows do not divide over the workers x micro-batches is refused ('does not "
               "split evenly')", "fixed: zeroray/engine/batch.py, [Note: uneven splits]"),
    # found by this fuzzer (issue 41): a rank whose routing needs a parameter the other does not
    # waited in a negotiated gather for a peer that was blocked in the user's collective on the
    # default group, which takes no part in zeroray's negotiation: both timed out
    "diverge_dist": ("stage 3 on 2-3 workers whose rows route to different experts, with a user collective "
                     "(SyncBatchNorm, dist.all_reduce in loss_fn) after the divergence: hung until the collective "
                     "timeout (gloo 'Timed out waiting ... for recv' / 'Connection closed by peer')",
                     "fixed: zeroray/fetch/unit_fetcher.py, [Note: answering rounds outside zeroray]"),
}
EXCLUDABLE = ("buffers", "unused", "varshape", "eval", "uneven", "diverge_dist")


@dataclass
class Case:
    seed: int
    model: ModelSpec
    config: RunConfig
    padded: bool
    varshape: bool
    unused: bool
    evaluate: bool = False
    agree_first: int = 0   # steps in which every worker routes its rows alike (see _agree)
    without: FrozenSet[str] = field(default_factory=frozenset)
    batches: List[dict] = field(default_factory=list, repr=False)
    eval_batch: Optional[dict] = field(default=None, repr=False)

    def model_fn(self):
        return functools.partial(FuzzNet, self.model)

    def loss_fn(self):
        return functools.partial(fuzz_loss, self.model)

    def logits_fn(self):
        return functools.partial(fuzz_logits, self.model)

    def gaps(self) -> FrozenSet[str]:
        """The known gaps this case exercises (what its batches actually do)."""
        out = set()
        if self.config.dtype != "fp32" and self.model.float_buffers_in_compute:
            out.add("buffers")
        if len({b["idx"].shape[1] for b in self.batches}) > 1:
            out.add("varshape")
        if self.model.routed and (any(len(set(b["route"].tolist())) < self.model.experts for b in self.batches)
                                  or self._unused_in_last_micro_batch()):
            out.add("unused")
        if self.evaluate:
            out.add("eval")
        parts = self.config.world * self.config.accum
        if any(b["idx"].shape[0] % parts for b in self.batches):
            out.add("uneven")
        if diverges_with_dist(self.model, self.config):
            out.add("diverge_dist")
        return frozenset(out)

    def _unused_in_last_micro_batch(self) -> bool:
        """Stages 0-1 with accumulation: an expert in a worker's earlier micro-batch but not its last."""
        world, accum = self.config.world, self.config.accum
        if self.config.zero["stage"] not in (0, 1) or accum == 1:
            return False
        for batch in self.batches:
            parts = [mb for share in split_batch(batch["route"], world) for mb in split_batch(share, accum)]
            for rank in range(world):
                mine = [set(p.tolist()) for p in parts[rank * accum:(rank + 1) * accum]]
                if set().union(*mine[:-1]) - mine[-1]:
                    return True
        return False

    def describe(self) -> str:
        data = [k for k, on in (("padded", self.padded), ("varshape", self.varshape), ("unused", self.unused),
                                ("evaluate", self.evaluate), (f"agree_first={self.agree_first}", self.agree_first))
                if on]
        return f"{self.config.describe()} | {self.model.describe()} | data: {','.join(data) or 'plain'}"

    def rerun(self) -> str:
        without = f" --without {','.join(sorted(self.without))}" if self.without else ""
        return f"python benchmarks/fuzz.py --case {self.seed}{without}"


def make_case(seed: int, without: FrozenSet[str] = frozenset(), max_world: int = 3) -> Case:
    unknown = set(without) - set(EXCLUDABLE)
    if unknown:
        raise ValueError(f"without={sorted(unknown)} is unknown: choose from {EXCLUDABLE}")
    rng = random.Random(seed)
    config = sample_config(rng, max_world=max_world)
    lowp = config.dtype != "fp32"
    model = sample_model(rng, buffers=not (lowp and "buffers" in without))
    padded = rng.random() < 0.5
    # every draw is made whatever ``without`` says, so the batches stay the same
    varshape = rng.random() < 0.3 and "varshape" not in without
    unused = rng.random() < 0.5 and model.routed and "unused" not in without
    evaluate = rng.random() < 0.3 and "eval" not in without
    agree = rng.randint(1, 2) if rng.random() < 0.5 and model.routed else 0
    case = _with_batches(rng, seed, model, config, padded=padded, varshape=varshape, unused=unused,
                         evaluate=evaluate, agree_first=agree, without=frozenset(without))
    case.config = sample_extras(rng, case.config)
    # drawn last (adding it changed no earlier draw), and whatever ``without`` says
    parts = case.config.world * case.config.accum
    extra = rng.randint(1, parts - 1) if rng.random() < 0.3 and parts > 1 else 0
    if extra and "uneven" not in without:
        _add_rows(case, extra)
    case.config = sample_recipe(rng, case.config)
    sync_bn = rng.random() < 0.5 and "bn" in model.blocks
    case.model = dataclasses.replace(model, sync_bn=sync_bn, dist_loss=rng.random() < 0.3)
    if "diverge_dist" in without and diverges_with_dist(case.model, case.config):
        case.model = dataclasses.replace(case.model, sync_bn=False, dist_loss=False)
    return case


def diverges_with_dist(model: ModelSpec, config: RunConfig) -> bool:
    """Stage 3 on several workers that may run different experts, with a user collective after
    them (GAPS["diverge_dist"])."""
    return (config.zero["stage"] == 3 and config.world > 1 and model.routed
            and (model.dist_loss or (model.sync_bn and "bn" in model.blocks)))


def _add_rows(case: Case, extra: int) -> None:
    """Every batch (the evaluation's too) gains ``extra`` rows, copies of its first ones, so that
    it no longer divides over the workers x micro-batches ([Note: uneven splits] in
    zeroray/engine/batch.py)."""
    grow = lambda batch: {k: torch.cat([v, v[:extra]]) for k, v in batch.items()}  # noqa: E731
    case.batches = [grow(b) for b in case.batches]
    if case.eval_batch is not None:
        case.eval_batch = grow(case.eval_batch)


def _agree(case: Case, steps: int) -> None:
    """In the first ``steps`` steps every micro-batch of every worker routes its rows to experts
    0, 1, ... in turn, so all workers run the same modules in the same order (at stage 3 they
    agree on a trace and follow it, and leave it in the middle of the step that diverges)."""
    case.agree_first = min(steps, len(case.batches))
    rows = case.config.rows
    for batch in case.batches[:case.agree_first]:
        parts = batch["route"].numel() // rows
        batch["route"] = (torch.arange(rows) % case.model.experts).repeat(parts)


def build_case(seed: int, model: ModelSpec, config: RunConfig, *, padded: bool = False, varshape: bool = False,
               unused: bool = False, evaluate: bool = False) -> Case:
    """A case of a chosen model and configuration (tests that need particular features); its
    batches are drawn from ``random.Random(seed)``. ``make_case`` draws everything."""
    return _with_batches(random.Random(seed), seed, model, config, padded=padded, varshape=varshape, unused=unused,
                         evaluate=evaluate)


def _with_batches(rng: random.Random, seed: int, model: ModelSpec, config: RunConfig, *, padded: bool,
                  varshape: bool, unused: bool, evaluate: bool, agree_first: int = 0,
                  without: FrozenSet[str] = frozenset()) -> Case:
    cover_parts = 1
    if model.routed and not unused:
        if config.zero["stage"] in (0, 1) and config.accum > 1 or agree_first:
            # an expert used in a worker's earlier micro-batch but not in its last: see GAPS["unused"]
            cover_parts = config.world * config.accum
        config = with_rows_at_least(config, model.experts * cover_parts)  # room for a row per expert
    batches = make_batches(rng, model, config.global_rows, config.steps + evaluate, padded=padded,
                           varshape=varshape, unused=unused, cover_parts=cover_parts)
    eval_batch = batches.pop() if evaluate else None
    case = Case(seed=seed, model=model, config=config, padded=padded, varshape=varshape, unused=unused,
                evaluate=evaluate, without=without, batches=batches, eval_batch=eval_batch)
    if agree_first:
        _agree(case, agree_first)
    return case
